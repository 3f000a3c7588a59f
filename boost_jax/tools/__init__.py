"""Command-line tools: the communication report (``comm_report``)."""

"""Tokenizers, the ``prepare`` command (text -> token memmap) and the grain input pipeline."""

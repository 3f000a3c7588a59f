"""Interoperability with other frameworks: Hugging Face LLaMA import, SVD initialisation."""

"""Evaluation of a trained run: held-out perplexity on any mesh (:mod:`.perplexity`), batched
log-likelihood scoring of token sequences (:mod:`.scoring`) and the lm-evaluation-harness
adapter (:mod:`.harness`, needs the ``eval`` extra). ``python -m boost_jax.eval`` is the
command."""

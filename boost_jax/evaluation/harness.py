"""A boost_jax run as an lm-evaluation-harness model (needs the ``eval`` extra: ``pip install
-e ".[eval]"``).

:class:`BoostLM` is registered with lm-eval as ``boost_jax`` once this module is imported
(``lm_eval.simple_evaluate(model="boost_jax", model_args="workdir=runs/default")`` then
works too) and serves the three request types on one device:

* ``loglikelihood`` -- ``(context, continuation)`` pairs, tokenized by lm-eval's
  :class:`~lm_eval.api.model.TemplateLM` (the context's trailing spaces move to the
  continuation; an empty context is the end-of-text id) and scored in batches of padded
  length buckets (:class:`~boost_jax.evaluation.scoring.Scorer`);
* ``loglikelihood_rolling`` -- a whole text in disjoint windows of ``max_length`` tokens
  (lm-eval's rolling windows), summed;
* ``generate_until`` -- :func:`boost_jax.models.decode.generate` (greedy unless the task
  samples), prompts left-truncated to fit ``max_length``, ``max_gen_toks`` new tokens (default
  256), the text cut at the first ``until`` string; requests with the same generation
  arguments are batched together.

``max_length`` defaults to the run's ``Train.seq_len``, the context it was trained on.
:func:`run_tasks` runs tasks by name, YAML task files under ``include_path`` included.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from boost_jax.errors import ConfigError
from boost_jax.evaluation.scoring import Scorer
from boost_jax.train.trained import Trained, load_trained

DEFAULT_MAX_GEN_TOKS = 256


@register_model("boost_jax")
class BoostLM(TemplateLM):
    """A trained run (``trained``, or the checkpoint ``step`` of ``checkpoint_dir``, default
    ``<workdir>/checkpoints``) for lm-eval.

    Args:
      max_length: tokens a scored row or a generation (prompt and new tokens) may hold
        (default: the run's ``Train.seq_len``).
      batch_size: rows per scoring call and prompts per generation call.
      dtype: compute dtype, ``float32`` or ``bfloat16``.
      max_gen_toks: new tokens of a generation whose task does not say.
      seed: sampling seed of the tasks that sample.
    """

    def __init__(self, workdir: str | None = None, step: int | str | None = None,
                 trained: Trained | None = None, max_length: int | str | None = None,
                 batch_size: int | str = 16, dtype: str = "float32",
                 max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS, seed: int | str = 0,
                 max_batch_size: int | None = None, device: str | None = None,
                 checkpoint_dir: str | None = None):
        del max_batch_size, device  # what lm-eval passes every model; one device here
        super().__init__()
        if trained is None:
            if workdir is None and checkpoint_dir is None:
                raise ConfigError("BoostLM needs a workdir (model_args workdir=...), a "
                                  "checkpoint_dir or a Trained run")
            trained = load_trained(workdir, None if step is None else int(step), checkpoint_dir)
        self.trained, self.cfg = trained, trained.model
        self.tok = trained.tokenizer()
        self.max_length = int(max_length or trained.config.train.seq_len)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.dtype = jnp.dtype(dtype)
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self.scorer = Scorer(self.cfg, trained.params, self.max_length, self.batch_size,
                             dtype)

    # --- tokens ---------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eos_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context conditions on: BOS where the tokenizer has one, else EOT."""
        bos = self.tok.bos_id
        return int(bos) if bos is not None and bos >= 0 else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return f"boost_jax:{self.trained.source}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return self.tok.encode_batch([string])[0]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict:
        m = self.cfg
        return {"boost_jax_workdir": self.trained.source, "step": self.trained.step,
                "arch": m.arch, "size": m.size, "max_length": self.max_length,
                "dtype": self.dtype.name}

    # --- requests -------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``[((context, continuation), context_ids, continuation_ids)]`` -> ``(log-likelihood,
        greedy)`` each."""
        results = self.scorer.score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each request's whole text (``args = (text,)``)."""
        pieces, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id,
                                                    self.max_length, 1):
                pieces.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self.scorer.score(pieces) if pieces else []):
            totals[i] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each request's context (``args = (context, gen_kwargs)``) until one of
        ``gen_kwargs['until']`` (default: the end-of-text token) or ``max_gen_toks``."""
        from boost_jax.models.decode import generate

        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        out: list[str] = [""] * len(requests)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until, new_tokens, temperature, top_p = self._generation_args(kwargs)
            room = max(self.max_length - new_tokens, 1)
            prompts = [self.tok_encode(requests[i].args[0])[-room:] or [self.prefix_token_id]
                       for i in indices]
            for start in range(0, len(prompts), self.batch_size):
                batch = prompts[start:start + self.batch_size]
                tokens = generate(self.cfg, self.scorer.params, batch, new_tokens, temperature,
                                  top_p, self.seed, (self.eot_token_id,), self.dtype)
                for i, ids in zip(indices[start:start + self.batch_size], tokens):
                    out[i] = cut_at(self.tok_decode(ids), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _generation_args(self, kwargs: dict) -> tuple[list[str], int, float, float]:
        """``(until strings, new tokens, temperature, top_p)`` of a task's ``gen_kwargs``."""
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        eot = self.tok_decode([self.eot_token_id])
        if eot and eot not in until:
            until.append(eot)
        new_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        sample = kwargs.pop("do_sample", None)
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        if sample is False:
            temperature = 0.0
        elif sample and temperature == 0.0:
            temperature = 1.0
        top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
        return until, new_tokens, temperature, top_p


def cut_at(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of the ``until`` strings."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def run_tasks(lm: BoostLM, tasks: Sequence[str], include_path: str | Path | None = None,
              limit: int | float | None = None, num_fewshot: int | None = None,
              default_tasks: bool = True, bootstrap_iters: int = 100000,
              seed: int = 0) -> dict:
    """Run lm-eval ``tasks`` (names or glob patterns) on ``lm``; returns lm-eval's results
    dict (``results[task][metric]``). ``include_path``: a directory of task YAML files added
    to the index; ``default_tasks=False`` indexes only those (lm-eval's own index of
    thousands of tasks takes seconds to build). An unknown task or a missing include path is a
    one-line :class:`ConfigError`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include_path={include_path} is not a directory of task YAML "
                          "files")
    if not default_tasks and include_path is None:
        raise ConfigError("--only_include_path needs --include_path=DIR (a directory of task "
                          "YAML files)")
    manager = TaskManager(include_path=None if include_path is None else str(include_path),
                          include_defaults=default_tasks)
    names: list[str] = []
    for pattern in tasks:
        matched = [pattern] if pattern in manager.all_tasks else manager.match_tasks([pattern])
        if not matched:
            where = f" (nor under {include_path})" if include_path is not None else ""
            raise ConfigError(f"unknown lm-eval task {pattern!r}{where}; python -m lm_eval ls "
                              "tasks lists them, --include_path=DIR adds task YAML files")
        names += [n for n in matched if n not in names]
    results = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                              num_fewshot=num_fewshot, log_samples=False,
                              bootstrap_iters=bootstrap_iters, random_seed=seed,
                              numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    if results is None:  # only on non-zero ranks of a multi-process lm-eval run
        raise RuntimeError("lm-eval returned no results")
    return results

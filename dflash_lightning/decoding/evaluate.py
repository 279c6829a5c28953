"""Evaluate a drafter by real speculative decoding, greedy or sampled (docs/method.md sections 5, 6, 6b): tau, speedup.

`evaluate` works on an in-memory drafter and Hugging Face target on any device (training-time validation
calls it) and returns the report of `summarize`, with each part's own served report; the `evaluate` command
(`commands/evaluate.py`) runs it per temperature asked for and writes report.json and report.png.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_lightning.data.conversations import open_lines
from dflash_lightning.decoding.batched import BatchedDecoder
from dflash_lightning.decoding.speculative import Generation, SpeculativeDecoder
from dflash_lightning.hf.modeling_dflash import check_sampling
from dflash_lightning.model import DFlashDrafter
from dflash_lightning.parts.base import Part, ServedSettings


def prompt_ids(tokenizer: Any, row: dict[str, Any], enable_thinking: bool = False) -> list[int]:
    """Token ids of one prompt row (`messages` or `prompt`): chat template with the generation prompt."""
    if "messages" in row:
        messages = list(row["messages"])
        while messages and messages[-1]["role"] == "assistant":  # a training row ends with its answer
            messages.pop()
    elif "prompt" in row:
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError(f"a prompt row needs 'messages' or 'prompt', got keys {sorted(row)}")
    if not messages:
        raise ValueError("a prompt row has no message before the assistant's answer")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target's tokenizer has no chat template")
    # enable_thinking is read by Qwen3's template and ignored by templates without it.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds any BOS itself


def stop_token_ids(tokenizer: Any, target_model: nn.Module | None = None) -> list[int]:
    """The tokenizer's EOS and the target's generation-config EOS ids (Qwen3 ends turns with <|im_end|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(target_model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, list | tuple) else ({extra} if extra is not None else set())
    return sorted(ids)


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    target_model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[dict[str, Any]],
    max_new_tokens: int = 256,
    stop_ids: Sequence[int] | None = None,
    enable_thinking: bool = False,
    progress: bool = True,
    warmup: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    baseline: bool = True,
    served: ServedSettings | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Speculative and target-only decoding of every prompt (greedy at temperature 0, else sampled with top-p and
    top-k); the report of `summarize` and the sampling settings.

    The drafter must sit on the target's device with its embedding and head attached (or it takes the
    target's). `prompts` are rows with `messages` or `prompt` and an optional `category`. Prompt i samples from
    its own random stream `prompt_seed(seed, i)`, so a report is reproduced by its seed, prompt by prompt.
    `baseline` false skips the target alone (no speedup, no mismatch count: `calibrate` needs only the served
    blocks); `served`: what the parts' served reports are given (a cost model, a calibration). `batch_size` > 1
    decodes that many prompts together (`BatchedDecoder`: the same tokens and random streams as one at a time); a
    prompt's seconds are then its batch's wall time over the batch's prompts, so `speedup` is the ratio of the target
    alone's and the speculative decoder's throughput at that batch, not a latency (benchmarks/decode_speed.py is).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_sampling(temperature, top_p, top_k)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    device = next(target_model.parameters()).device
    if drafter.fc.weight.device != device:
        raise ValueError(f"drafter is on {drafter.fc.weight.device}, the target on {device}")
    modes = drafter.training, target_model.training
    drafter.eval(), target_model.eval()
    decoder = SpeculativeDecoder(target_model, drafter) if batch_size == 1 else BatchedDecoder(target_model, drafter)
    stop = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, target_model)
    encoded = [torch.tensor(prompt_ids(tokenizer, row, enable_thinking), device=device) for row in prompts]

    def decode(generate, ids: list[torch.Tensor], first: int, n: int) -> list[Generation]:
        """Prompts `first..` decoded alone or as one batch, prompt i from its stream `prompt_seed(seed, i)`."""
        streams = [_generator(device, prompt_seed(seed, first + j)) if temperature else None for j in range(len(ids))]
        if batch_size == 1:
            return [generate(ids[0], n, stop, **sampling, generator=streams[0])]
        return generate(ids, n, stop, **sampling, generators=streams)

    if warmup and encoded:  # first calls pay for kernel selection and allocation, not decoding
        decode(decoder.generate, encoded[:batch_size], 0, min(8, max_new_tokens))
        if baseline:
            decode(decoder.target_generate, encoded[:batch_size], 0, min(8, max_new_tokens))
    records = []
    label = f"temperature {temperature:g}: speculative decoding" if temperature else "speculative decoding"
    with _progress(progress) as bar:
        task = bar.add_task(label, total=len(encoded))
        for first in range(0, len(encoded), batch_size):
            ids = encoded[first: first + batch_size]
            specs = decode(decoder.generate, ids, first, max_new_tokens)
            bases = decode(decoder.target_generate, ids, first, max_new_tokens) if baseline else [None] * len(ids)
            for row, prompt, spec, base in zip(prompts[first: first + batch_size], ids, specs, bases, strict=True):
                records.append({
                    "category": row.get("category"), "prompt_tokens": int(prompt.numel()),
                    "new_tokens": len(spec.tokens), "steps": spec.steps, "accepted_lengths": spec.accepted_lengths,
                    "step_tokens": spec.step_tokens,
                    "verified_lengths": verified_lengths(spec.accepted_lengths, decoder.drafts, max_new_tokens),
                    "expected_accepted": spec.expected_accepted, "extras": spec.extras,
                    # sampled outputs differ from the target's own samples by design; only greedy ones must be equal
                    "first_mismatch": (first_mismatch(spec.tokens, base.tokens)
                                       if temperature == 0 and base is not None else None),
                    # a batch's wall time is shared by its prompts: summed, the records give the whole run's
                    "speculative_seconds": spec.seconds / len(ids),
                    "target_seconds": base.seconds / len(ids) if base is not None else None,
                })
            tau = pooled_tau(records)
            bar.update(task, advance=len(ids), description=f"{label}, tau {tau or 0:.2f}")
    drafter.train(modes[0]), target_model.train(modes[1])
    return {**summarize(records, drafter.config.block_size, max_new_tokens, greedy=temperature == 0 and baseline,
                        drafts=decoder.drafts, parts=drafter.config.preset.parts, served=served), **sampling,
            "seed": seed, "batch_size": batch_size}


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index`'s random stream in a report of seed `seed` (distinct for every pair)."""
    return seed * 1_000_003 + index


def verified_lengths(accepted: list[int], drafts: int, max_new_tokens: int) -> list[int]:
    """Drafts each step verified (`SpeculativeDecoder.generate`): all `drafts` of the block but where the tokens
    still wanted cut the last step short (a step after t tokens verifies max_new_tokens - t - 1 at most)."""
    out, made = [], 1  # the prefill made the first token
    for a in accepted:
        out.append(max(0, min(drafts, max_new_tokens - made - 1)))
        made += a + 1
    return out


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts); None if identical."""
    n = min(len(a), len(b))
    i = next((i for i in range(n) if a[i] != b[i]), n)
    return None if i == n and len(a) == len(b) else i


def pooled_tau(records: list[dict[str, Any]]) -> float | None:
    """All counted tokens over all decode steps of these prompts (docs/method.md section 6); None without steps."""
    steps = sum(len(r["step_tokens"]) for r in records)
    return sum(sum(r["step_tokens"]) for r in records) / steps if steps else None


def summarize(records: list[dict[str, Any]], block_size: int, max_new_tokens: int, greedy: bool = True,
              drafts: int | None = None, parts: Sequence[type[Part]] = (), served: ServedSettings | None = None
              ) -> dict[str, Any]:
    """tau, acceptance histogram, per-slot acceptance, per-category tau, speedup and mismatches of per-prompt runs.

    tau counts per docs/method.md section 6 (`step_tokens`: a + 1 per step, the last step only up to the stop token or
    the length limit): `tau_pooled` is all counted tokens over all steps, `tau_prompt_mean` the mean of each
    prompt's own tau (the reference benchmark prints both). The histogram and per-slot acceptance are of the
    accepted drafts a as verified. tokens_per_step is all new tokens (the prefill's included) over all decode
    steps, what a serving engine gets per target forward. `expected_tau_pooled` is the mean over steps of 1 + the
    step's expected accepted count `sum_k prod_{i<=k} r_i`, `r_i = P_i(d_i)` for argmax drafts (section 6b) and
    `min(1, P_i(d_i) / q_i(d_i))` for DFlash2's sampled ones (section 10): a itself when greedy, the sampled
    count's expectation, without its noise, when sampling; it counts the last step whole (its tokens past a stop
    cannot be told apart in expectation), so it can exceed `tau_pooled` by that step's share. Mismatches with the
    target alone are counted for greedy runs only (None when sampled). `drafts`: drafts a block (None: B - 1; DSpark's
    anchor-first block drafts B). Each of the drafter's `parts` adds its served report (`Part.served_report` with
    `served`: DSpark's adaptive verification and calibration of its confidences). Records without the target alone
    (`target_seconds` None) give no speedup.
    """
    drafts = block_size - 1 if drafts is None else drafts
    accepted = [a for r in records for a in r["accepted_lengths"]]
    histogram = [accepted.count(a) for a in range(drafts + 1)]
    steps = len(accepted)
    spec_s = sum(r["speculative_seconds"] for r in records)
    timed = [r["target_seconds"] for r in records]
    target_s = None if None in timed else sum(timed)
    records = [{**r, "tau": pooled_tau([r])} for r in records]  # each prompt's own tau

    def taus(rs: list[dict[str, Any]]) -> dict[str, Any]:
        per_prompt = [r["tau"] for r in rs if r["tau"] is not None]
        n_steps = sum(len(r["step_tokens"]) for r in rs)
        expected = [e for r in rs for e in r["expected_accepted"]]
        return {
            "num_prompts": len(rs),
            "tau_pooled": pooled_tau(rs),
            "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
            "expected_tau_pooled": 1 + sum(expected) / len(expected) if expected else None,
            "tokens_per_step": sum(r["new_tokens"] for r in rs) / n_steps if n_steps else None,
        }

    categories = sorted({r["category"] for r in records if r["category"] is not None})
    return {
        **taus(records),
        "block_size": block_size,
        "max_new_tokens": max_new_tokens,
        "mismatches": sum(r["first_mismatch"] is not None for r in records) if greedy else None,
        "steps": steps,
        "new_tokens": sum(r["new_tokens"] for r in records),
        "acceptance_histogram": histogram,
        "slot_acceptance": [sum(a >= k for a in accepted) / steps if steps else None for k in range(1, drafts + 1)],
        "speculative_seconds": spec_s,
        "target_seconds": target_s,
        "speedup": target_s / spec_s if spec_s > 0 and target_s is not None else None,
        "per_category": {c: taus([r for r in records if r["category"] == c]) for c in categories},
        **{key: value for part in parts for key, value in part.served_report(records, served).items()},
        "prompts": records,
    }


def print_summary(runs: list[dict[str, Any]]) -> None:
    """A short rich table of the reports of `evaluate`, one block of rows per temperature."""
    from rich.console import Console
    from rich.table import Table

    def fmt(x: float | None, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    table = Table(title="DFlash speculative decoding", caption=(
        "T: temperature. expected tau: 1 + sum_k prod_{i<=k} r_i of the same verifications, pooled, r_i = P_i(d_i) "
        "(docs/method.md 6b; min(1, P/q) for sampled DFlash2 drafts). mismatches: outputs unlike the target alone's "
        "(greedy only)."))
    for col in ("T", "prompts", "category", "tau pooled", "tau prompt mean", "expected tau", "tokens/step", "speedup",
                "mismatches"):
        table.add_column(col, justify="right")
    for run in runs:
        mismatches = "-" if run["mismatches"] is None else str(run["mismatches"])
        table.add_row(f"{run['temperature']:g}", str(run["num_prompts"]), "all", fmt(run["tau_pooled"]),
                      fmt(run["tau_prompt_mean"]), fmt(run["expected_tau_pooled"]), fmt(run["tokens_per_step"]),
                      "-" if run["speedup"] is None else f"{run['speedup']:.2f}x", mismatches)
        for name, c in run["per_category"].items():
            table.add_row("", str(c["num_prompts"]), name, fmt(c["tau_pooled"]), fmt(c["tau_prompt_mean"]),
                          fmt(c["expected_tau_pooled"]), fmt(c["tokens_per_step"]), "", "")
    Console().print(table)


def parse_temperatures(value: str | float | Sequence[float]) -> list[float]:
    """Temperatures from `0,0.6,1` (or `[0, 0.6, 1]`, a number, a list); a bad entry is named."""
    if isinstance(value, str):
        items = [t.strip() for t in value.strip().strip("[]").split(",")]
    else:
        items = [value] if isinstance(value, int | float) else list(value)
    temperatures = []
    for item in items:
        try:
            t = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"temperature: '{item}' is not a number (give e.g. 0,0.6,1)") from None
        if math.isinf(t):  # softmax(logits / inf) is uniform noise, not a sampling setting anyone means
            raise ValueError(f"temperature: '{item}' is not finite (give e.g. 0,0.6,1)")
        check_sampling(t)
        temperatures.append(t)
    if not temperatures or len(set(temperatures)) != len(temperatures):
        raise ValueError(f"temperature: give distinct temperatures, got '{value}'")
    return temperatures


def read_prompts(path: str | Path, num_prompts: int | None = None) -> list[dict[str, Any]]:
    """Rows of a prompts JSONL file, gzipped or not (`{"messages": [...]}` or `{"prompt": str}`, optional
    `category`)."""
    rows = []
    with open_lines(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from err
                if not isinstance(row, dict) or not ({"messages", "prompt"} & set(row)):
                    raise ValueError(f"{path}:{number}: a prompt row needs 'messages' or 'prompt'")
                rows.append(row)
            if num_prompts is not None and len(rows) >= num_prompts:
                break
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    disable=not enabled)


__all__ = [
    "evaluate", "parse_temperatures", "pooled_tau", "print_summary", "prompt_ids", "prompt_seed", "read_prompts",
    "summarize", "verified_lengths",
]

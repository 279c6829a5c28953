"""One peer trainer's own training step for one variant, at step_bench's shape; prints and writes one JSON object.

Issue 57: this project's step (benchmarks/step_bench.py) against the trainers users would pick instead, each called
through its own code (imported from its installed wheel, never copied): the peer builds its drafter from a random
Qwen3-shaped target folder (step_bench.write_target), takes step_bench's packed random rows with random context
features, and runs its own step (forward, loss, backward, clipping, optimizer and scheduler, compiled where its
trainer compiles) for `--warmup` steps, then `--steps` timed steps synchronised at their ends only. One process per
(peer, variant); benchmarks/peers_gpu.sh runs ours and each peer side by side, docs/peers.md says what each step
includes and what cannot run.

    python benchmarks/peers_step.py --peer speculators --variant dflash --out X.json            # 8B shape, CUDA
    python benchmarks/peers_step.py --peer specforge --variant dspark --shape tiny --device cpu  # CPU smoke

The peers' packages are not project dependencies: put them on PYTHONPATH (peers_gpu.sh installs them with
`pip install --no-index --no-deps --target`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from benchmarks.step_bench import MASK_ID, QWEN3_8B, random_batch, write_result, write_target


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: the target's config, the packed row and the drafter both sides build."""

    target: dict
    token_budget: int
    anchors: int
    draft_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    doc_tokens: tuple[int, int]
    max_documents: int = 64


TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=4096,
                   tie_word_embeddings=False)
SHAPES = {
    # step_bench's defaults: Qwen3-8B target, 8192 tokens, 512 anchors, a 5-layer drafter of block 16
    "8b": Shape(QWEN3_8B, 8192, 512, 5, 16, MASK_ID, (1, 9, 17, 25, 33), (300, 3000)),
    "tiny": Shape(TINY_TARGET, 512, 16, 2, 16, 1023, (1, 6), (64, 300), max_documents=8),  # the CPU smoke
}
GAMMA = 7.0  # decay slot weights exp(-(k-1)/7) at block 16, as this project's step (variants_h200.sh `step`)

PEER_PACKAGES = {"speculators": "speculators", "specforge": "specforge", "modelopt": "nvidia-modelopt"}
RUNS = {  # (peer, variant) pairs whose trainer this script runs
    ("speculators", "dflash"), ("speculators", "dflash2"), ("speculators", "dspark"), ("speculators", "xpress"),
    ("specforge", "dflash"), ("specforge", "dspark"), ("specforge", "domino"),
    ("modelopt", "dflash"), ("modelopt", "dspark"), ("modelopt", "domino"),
}
CANNOT = {  # (peer, variant) pairs a user might expect, and why they are not run; also in docs/peers.md
    ("speculators", "domino"): "speculators 0.9.0 has no Domino (its registry: dflash, dflash2, dspark, eagle3, mtp, "
                               "peagle, xpress)",
    ("speculators", "lilicorr-conv"): "speculators 0.9.0 has no LiLiCorr",
    ("specforge", "dflash2"): "SpecForge 0.2.0 has no DFlash2 (its registry: eagle3, peagle, dflash, domino, dspark)",
    ("specforge", "xpress"): "SpecForge 0.2.0 has no XPress",
    ("specforge", "lilicorr-conv"): "SpecForge 0.2.0 has no LiLiCorr",
    ("modelopt", "dflash2"): "not in the ModelOpt 0.47.0 wheel (its DFlash family: projector types dflash, domino, "
                             "dspark; plugins/hf_dflash2.py is on its main branch only, no wheel of it on PyPI)",
    ("modelopt", "xpress"): "ModelOpt 0.47.0 has no XPress",
    ("modelopt", "lilicorr-conv"): "not in the ModelOpt 0.47.0 wheel (only on its main branch; no wheel of it on "
                                   "PyPI to carry)",
}


@dataclass
class StepClock:
    """Called once at each step's end: synchronises only at the warm-up's and the timed steps' ends."""

    warmup: int
    steps: int
    device: torch.device
    done: int = 0
    marks: dict = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self) -> None:
        self.sync()
        self.marks["start"] = time.perf_counter()

    def __call__(self) -> None:
        self.done += 1
        if self.done == 1:
            self.sync()
            self.marks["first"] = time.perf_counter()
        if self.done == self.warmup:
            self.sync()
            self.marks["warm"] = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
        if self.done == self.warmup + self.steps:
            self.sync()
            self.marks["end"] = time.perf_counter()

    def result(self) -> dict:
        if "end" not in self.marks:
            raise RuntimeError(f"the peer's loop stopped after {self.done} of {self.warmup + self.steps} steps")
        m = self.marks
        peak = torch.cuda.max_memory_allocated() / 1e9 if self.device.type == "cuda" else None
        return {"first_step_s": m["first"] - m["start"], "warmup_s": m["warm"] - m["start"],
                "step_s": (m["end"] - m["warm"]) / self.steps, "peak_gb": peak}


def packed_rows(shape: Shape, n: int, features: int, hidden: int, dtype: torch.dtype) -> list[dict]:
    """step_bench's packed random rows (the same documents ours trains on) with random context features and
    final hidden states, as [1, T, ...] tensors."""
    rows = []
    for seed in range(n):
        row = random_batch(shape.token_budget, shape.max_documents, seed, shape.mask_token_id, shape.doc_tokens)
        g = torch.Generator().manual_seed(10_000 + seed)
        rows.append({
            "input_ids": row["input_ids"][None], "position_ids": row["position_ids"][None],
            "document_ids": row["doc_ids"].long()[None], "loss_mask": row["loss_mask"].long()[None],
            "hidden_states": torch.randn(1, shape.token_budget, features, generator=g).to(dtype),
            "final_hidden": torch.randn(1, shape.token_budget, hidden, generator=g).to(dtype),
        })
    return rows


def cpu_accelerator_shims() -> None:
    """CPU smoke only: a peer trainer that synchronises `torch.accelerator` (none on a CPU) finds a no-op."""
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None


def run_speculators(variant: str, shape: Shape, target: Path, work: Path, clock: StepClock, rows: int) -> dict:
    """speculators 0.9: the model its `speculators train` CLI builds (train/cli.py build_draft_model from the
    resolved TrainConfig) and its own Trainer.train_epoch (autocast bf16, backward, clip 1.0, optimizer, scheduler,
    per-step metrics every `log_freq`); the drafter's forward is compiled by the package itself on CUDA."""
    import speculators.train.distributed as topology

    cpu = clock.device.type == "cpu"
    if cpu:
        topology._local_rank = clock.device  # the trainer moves model and batches to the local rank's device
        cpu_accelerator_shims()
    from speculators.model import SpeculatorModel
    from speculators.train import cli
    from speculators.train.config import TrainConfig
    from speculators.train.config.resolution import resolve
    from speculators.train.trainer import Trainer, TrainerConfig

    argv = ["--verifier-name-or-path", str(target), "--speculator-type", variant, "--data-path", str(work / "data"),
            "--save-path", str(work / "save"), "--total-seq-len", str(shape.token_budget),
            "--max-anchors", str(shape.anchors), "--block-size", str(shape.block_size),
            "--num-layers", str(shape.draft_layers), "--mask-token-id", str(shape.mask_token_id),
            "--target-layer-ids", *map(str, shape.target_layer_ids),
            # the same attention, objective, slot weights and optimizer as ours: full attention in every layer,
            # CE on the data's tokens, exp(-(k-1)/7) decay, AdamW (its DFlash recipe's default is Muon)
            "--full-attention-indices", *map(str, range(shape.draft_layers)),
            "--loss-fn", "ce", "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", str(GAMMA),
            "--optimizer", "adamw", "--max-steps", str(clock.warmup + clock.steps)]
    if cpu:  # FlexAttention has no CPU backward; its fused losses need Triton
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    cfg = resolve(TrainConfig, argv)
    args = argparse.Namespace(**cfg.flatten())
    d2t, t2d, draft_vocab = cli.parse_vocab_mappings(args)
    args.draft_vocab_size = draft_vocab
    model_class = SpeculatorModel.registry[variant]
    model = cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    hidden = shape.target["hidden_size"]
    batches = [{"input_ids": r["input_ids"], "position_ids": r["position_ids"], "document_ids": r["document_ids"],
                "loss_mask": r["loss_mask"], "hidden_states": r["hidden_states"],
                "verifier_last_hidden_states": r["final_hidden"], "error_records": 0}
               for r in packed_rows(shape, rows, len(model.target_layer_ids) * hidden, hidden, torch.bfloat16)]
    total = clock.warmup + clock.steps
    loader = torch.utils.data.DataLoader([batches[i % rows] for i in range(total)], batch_size=None, pin_memory=not cpu)
    config = TrainerConfig(
        lr=args.lr, num_epochs=1, save_path=args.save_path, train_call_kwargs=train_kwargs, optimizer=args.optimizer,
        weight_decay=args.weight_decay, scheduler_type=args.scheduler_type, hidden_states_dtype=torch.bfloat16,
        log_freq=args.log_freq, max_steps=total, checkpoint_freq=args.checkpoint_freq,
    )
    trainer = Trainer(model, config, loader)
    if cpu:
        trainer.device_type = "cpu"  # its autocast device (it asks torch.accelerator, which has none here)
    clock.start()
    trainer.train_epoch(0, step_callback=clock)
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "settings": {k: getattr(args, k) for k in (
                "lr", "weight_decay", "optimizer", "scheduler_type", "log_freq", "loss_fn", "loss_implementation",
                "per_position_loss_weight", "dflash_decay_gamma", "draft_attn_impl", "full_attention_indices",
                "target_layer_ids", "block_size", "max_anchors")},
            "optimizers": [type(o).__name__ for o in trainer.optimizers],
            "precision": "torch.autocast bf16 over fp32 weights (its Trainer)"}


def run_specforge(variant: str, shape: Shape, target: Path, work: Path, clock: StepClock, rows: int) -> dict:
    """SpecForge 0.2: the composite model its offline run assembles (training/assembly.py build_model_bundle), its
    FSDP backend over a one-rank process group (bf16 parameters in FSDP's mixed precision, its BF16Optimizer's
    fp32 master weights, clipping inside it) and its TrainerCore.train_step (strategy forward and loss, backward,
    optimizer); no torch.compile in its step (FlexAttention is compiled by the package on CUDA)."""
    import torch.distributed as dist
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config.schema import Config
    from specforge.training.assembly import _optimizer_factory, build_model_bundle
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import StepContext

    cpu = clock.device.type == "cpu"
    total = clock.warmup + clock.steps
    registry = builtin_algorithm_registry()

    def config(strategy: str, draft_config: Path | None = None) -> Config:
        model = {"target_model_path": str(target), "draft_num_hidden_layers": shape.draft_layers,
                 "draft_block_size": shape.block_size, "mask_token_id": shape.mask_token_id,
                 "aux_hidden_state_layer_ids": list(shape.target_layer_ids)}
        return Config.model_validate({
            "model": {**model, **({"draft_model_config": str(draft_config)} if draft_config else {})},
            "data": {"hidden_states_path": str(work / "hidden"), "max_length": shape.token_budget},
            "training": {"strategy": strategy, "max_steps": total, "num_anchors": shape.anchors,
                         "loss_decay_gamma": GAMMA, "learning_rate": 6e-4,
                         "lambda_base_decay_ratio": 1.0,  # Domino's base-loss weight to 0 over the run, as ours
                         "attention_backend": "sdpa" if cpu else "flex_attention"},
            "output_dir": str(work / "out"),
        })

    draft_config = None
    if variant in SPECFORGE_HEADS:  # it generates no draft config for these: its DFlash one, plus the heads
        from specforge.training.model_loading import resolve_draft_config

        base = resolve_draft_config(config("dflash"), provider=registry.resolve("dflash").providers.model.draft_config)
        fields = base.to_dict()
        fields["architectures"] = [registry.resolve(variant).providers.model.draft_config.architecture]
        fields["dflash_config"] = {**fields.get("dflash_config", {}), **SPECFORGE_HEADS[variant]}
        draft_config = work / f"{variant}-draft-config.json"
        draft_config.write_text(json.dumps(fields, default=str))
    cfg = config(variant, draft_config)
    if not dist.is_initialized():  # its trainer runs under torchrun; one rank here
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")})
        from specforge.distributed import init_distributed

        init_distributed(timeout=cfg.training.dist_timeout)
    algorithm = registry.resolve(variant)
    bundle = build_model_bundle(cfg, algorithm=algorithm)
    model = bundle.model.to(clock.device)
    optimizer_factory = _optimizer_factory(cfg)
    optimizer_factory.configure_total_steps(total)
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(sharding_strategy=cfg.training.fsdp_sharding),
                                  optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(model, wrap=not cpu, optimizer_target=model.draft_model)
    strategy = algorithm.providers.step.build(wrapped, target_head=bundle.target_head, **bundle.strategy_kwargs)
    core = TrainerCore(strategy, backend, accumulation_steps=cfg.training.accumulation_steps)
    hidden = bundle.target_hidden_size
    from specforge.runtime.contracts import TrainBatch

    batches = [TrainBatch(sample_ids=[str(i)], strategy=variant, tensors={
        "input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "hidden_states": r["hidden_states"],
        "target_last_hidden_states": r["final_hidden"]})
        for i, r in enumerate(packed_rows(shape, rows, len(shape.target_layer_ids) * hidden, hidden, torch.bfloat16))]
    clock.start()
    for step in range(total):
        core.train_step(batches[step % rows], StepContext(global_step=step, total_steps=total))
        clock()
    return {"trainable_params": sum(p.numel() for p in model.draft_model.parameters() if p.requires_grad),
            "settings": cfg.training.model_dump(include={
                "learning_rate", "lr_scheduler", "max_grad_norm", "fsdp_sharding", "attention_backend",
                "num_anchors", "loss_decay_gamma", "loss_type", "objective_chunk_blocks", "lambda_base_decay_ratio"}),
            **({"draft_heads": SPECFORGE_HEADS[variant]} if variant in SPECFORGE_HEADS else {}),
            "wrapped": backend._wrapper_kind, "optimizers": [type(backend.optimizer).__name__],
            "precision": "bf16 parameters (FSDP mixed precision) with its BF16Optimizer's fp32 master weights"
                         + ("; unwrapped on the CPU" if cpu else "")}


SPECFORGE_HEADS = {  # the draft-config fields of a SpecForge variant over its DFlash config: ours' DSpark heads (a
    # rank-256 vanilla Markov head, a confidence head reading it; parts/dspark.py's defaults)
    "dspark": {"projector_type": "dspark", "markov_rank": 256, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_alpha": 1.0, "confidence_head_with_markov": True},
    # ours' Domino (parts/domino.py): a 1024-wide GRU over the prefix, a 256-wide embedding projection, prefix 1
    "domino": {"projector_type": "domino", "gru_hidden_dim": 1024, "emb_dim": 256, "pure_draft_prefix_len": 1},
}
MODELOPT_HEADS = {  # dflash_architecture_config fields of a ModelOpt variant over DFlash: the same heads as above
    "dspark": {"projector_type": "dspark", "markov_rank": 256, "markov_head_type": "vanilla",
               "use_confidence_head": True, "confidence_head_with_markov": True},
    "domino": {"projector_type": "domino", "gru_hidden_dim": 1024, "emb_dim": 256, "pure_draft_prefix_len": 1},
}


def run_modelopt(variant: str, shape: Shape, target: Path, work: Path, clock: StepClock, rows: int) -> dict:
    """ModelOpt 0.47: its offline DFlash-family model (`load_vlm_or_llm` with a fake base: embedding and head only,
    `mtsp.convert(model, [("dflash", config)])`, the variant by projector type) trained by `transformers.Trainer`
    (bf16 autocast over fp32 weights, its default fused AdamW, clip 1.0); its examples' Trainer subclass
    (EagleTrainerWithAccLog, accuracy logging) is not in the wheel. `dflash_use_torch_compile` (its default, on)."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.plugins.hf_domino import DominoLambdaCallback
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cpu = clock.device.type == "cpu"
    total = clock.warmup + clock.steps
    model = load_vlm_or_llm(str(target), use_fake_base=True, use_offline_training=True, dtype="auto",
                            device_map="cpu")
    settings = {
        "dflash_offline": True, "dflash_block_size": shape.block_size, "dflash_num_anchors": shape.anchors,
        "dflash_loss_objective": "decay", "dflash_loss_decay_factor": GAMMA,
        "dflash_mask_token_id": shape.mask_token_id, "dflash_use_torch_compile": not cpu,
        "dflash_lambda_base_decay_ratio": 1.0,
        **({"dflash_confidence_head_alpha": 1.0} if variant == "dspark" else {}),
        # the layer widths given: it builds the draft's config as transformers' Qwen3Config, whose defaults (an
        # intermediate size of 22016, 32 KV heads) win over its inheriting the target's
        "dflash_architecture_config": {"num_hidden_layers": shape.draft_layers,
                                       "target_layer_ids": list(shape.target_layer_ids),
                                       **{k: shape.target[k] for k in ("intermediate_size", "num_attention_heads",
                                                                       "num_key_value_heads", "head_dim")},
                                       **MODELOPT_HEADS.get(variant, {})},
    }
    mtsp.convert(model, [("dflash", settings)])
    hidden = shape.target["hidden_size"]
    data = [{"input_ids": r["input_ids"][0], "loss_mask": r["loss_mask"][0].float(),
             "attention_mask": (r["document_ids"][0] >= 0).long(),
             "base_model_outputs": {"aux_hidden_states": r["hidden_states"][0],
                                    "base_model_hidden_states": r["final_hidden"][0]}}
            for r in packed_rows(shape, rows, len(shape.target_layer_ids) * hidden, hidden, torch.bfloat16)]

    def collate(items: list[dict]) -> dict:
        (item,) = items
        return {"input_ids": item["input_ids"][None], "attention_mask": item["attention_mask"][None],
                "loss_mask": item["loss_mask"][None],
                "base_model_outputs": {k: v[None] for k, v in item["base_model_outputs"].items()}}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start()

        def on_step_end(self, *a, **k):
            clock()

    arguments = TrainingArguments(
        output_dir=str(work / "out"), max_steps=total, per_device_train_batch_size=1, learning_rate=6e-4,
        bf16=True, max_grad_norm=1.0, logging_steps=8, save_strategy="no", report_to=[],
        remove_unused_columns=False, dataloader_num_workers=0, use_cpu=cpu, disable_tqdm=True)
    callbacks = [Clock(), *([DominoLambdaCallback()] if variant == "domino" else [])]
    trainer = Trainer(model=model, args=arguments, train_dataset=[data[i % rows] for i in range(total)],
                      data_collator=collate, callbacks=callbacks)
    trainer.train()
    return {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "settings": {k: v for k, v in settings.items() if k != "dflash_offline"},
            "optimizers": [type(trainer.optimizer).__name__, arguments.optim],
            "precision": "transformers.Trainer bf16=True: autocast bf16 over fp32 weights"}


RUNNERS: dict[str, Callable[..., dict]] = {"speculators": run_speculators, "specforge": run_specforge,
                                           "modelopt": run_modelopt}
OURS_RUN = "compiled[default][bf16-mixed]"  # step_bench's run name of the compiled bf16-mixed step


def collect(folder: Path) -> list[dict]:
    """Per variant and peer in `folder` (peers_gpu.sh's ours-V.json and PEER-V.json): both step times, the ratio
    (peer / ours: how many times faster ours is), peak memory and the card; a peer that failed names its log."""
    rows = []
    for ours_file in sorted(folder.glob("ours-*.json")):
        variant = ours_file.stem.removeprefix("ours-")
        ours = json.loads(ours_file.read_text())
        mine = ours.get("drafter_step", {}).get(OURS_RUN, {})
        for peer in sorted(PEER_PACKAGES):
            row = {"variant": variant, "peer": peer, "ours_step_s": mine.get("step_s"),
                   "ours_peak_gb": mine.get("peak_gb"), "ours_card": ours.get("gpu")}
            peer_file, log = folder / f"{peer}-{variant}.json", folder / f"{peer}-{variant}.log"
            if peer_file.exists():
                theirs = json.loads(peer_file.read_text())
                row.update({"peer_step_s": theirs.get("step_s"), "peer_peak_gb": theirs.get("peak_gb"),
                            "peer_card": theirs.get("device"), "cannot_run": theirs.get("cannot_run")})
                if row["peer_step_s"] and row["ours_step_s"]:
                    row["ratio"] = row["peer_step_s"] / row["ours_step_s"]
            elif log.exists():
                row["failed"] = (log.read_text().strip().splitlines() or ["(empty log)"])[-1][:300]
            else:
                continue
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=sorted(PEER_PACKAGES))
    parser.add_argument("--variant", help="this project's variant name (dflash, dspark, ...)")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=12, help="untimed steps (compilation, autotuning)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--rows", type=int, default=8, help="distinct random packed rows, served round-robin")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--collect", type=Path, default=None, help="print the table of a peers_gpu.sh OUT folder")
    args = parser.parse_args()
    if args.collect:
        for row in collect(args.collect):
            print(json.dumps(row))
        return
    if not (args.peer and args.variant):
        parser.error("--peer and --variant are required (or --collect)")
    key = (args.peer, args.variant)
    device = torch.device(args.device)
    result = {"peer": args.peer, "variant": args.variant, "shape": args.shape, **asdict(SHAPES[args.shape]),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "warmup_steps": args.warmup, "steps": args.steps}
    try:
        result["peer_version"] = version(PEER_PACKAGES[args.peer])
    except PackageNotFoundError:
        result["peer_version"] = None
    if key in CANNOT or key not in RUNS:
        result["cannot_run"] = CANNOT.get(key, f"{args.peer} has no {args.variant} trainer known to this script")
    else:
        torch.manual_seed(0)
        torch.set_float32_matmul_precision("high")
        clock = StepClock(args.warmup, args.steps, device)
        with tempfile.TemporaryDirectory() as tmp:
            target = write_target(Path(tmp) / "target", SHAPES[args.shape].target, final_norm=True)
            result.update(RUNNERS[args.peer](args.variant, SHAPES[args.shape], target, Path(tmp), clock, args.rows))
        result.update(clock.result())
        result["context_tokens_per_s"] = SHAPES[args.shape].token_budget / result["step_s"]
    write_result(result, args.out)


if __name__ == "__main__":
    main()

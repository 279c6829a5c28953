"""The feature cache: stored features equal the target's (bf16 bitwise, fp8 within its rounding bound), a fit
from the cache sees the same batches and losses as online, resume after an interruption, refused mismatches,
and damaged shards named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import fine_tune, make_target
from lightning.pytorch import Callback, Trainer, seed_everything
from test_cli import CONFIGS, write_conversations

import dflash_lightning.data.feature_cache as fc
import dflash_lightning.data.feature_cache_writer as fcw
from dflash_lightning.commands.cli import cli_main
from dflash_lightning.config import ConfigError, DrafterConfig
from dflash_lightning.data import DFlashDataModule
from dflash_lightning.data.feature_cache import FeatureCache, FeatureCacheError, dequantize, quantize_fp8
from dflash_lightning.module import DFlashModule
from dflash_lightning.target_model import FeatureExtractor, TargetFeatures
from dflash_lightning.target_model.fingerprints import TargetChangedError

LAYER_IDS = [1, 3]  # the default for a 2-layer drafter on a 6-layer target
SHARD_GB = "0.00008"  # ~80 KB: the 40 training samples spread over several shards



@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread) -> dict:
    """A tiny target, data, a fit config and a bf16 and an fp8 cache of them made through the CLI."""
    root = tmp_path_factory.mktemp("fc")
    target = make_target(root / "target", layers=6, hidden=32, heads=2, kv_heads=1)
    train = write_conversations(root / "train.jsonl", 40)
    val = write_conversations(root / "val.jsonl", 8, seed=1)
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    config["target"]["path"] = str(target)
    config["data"].update(train_files=[str(train)], val_files=[str(val)], token_budget=256, max_documents=8)
    config["model"]["drafter"].update(num_layers=2, block_size=8)
    config["trainer"].update(callbacks=[], logger=False)
    config.pop("spec_eval", None)  # off (its prompts are not part of this data)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    for fmt in ("bf16", "fp8"):
        cli_main(["cache", "--config", str(path), "--out", str(root / fmt), "--format", fmt, "--shard_gb", SHARD_GB])
    return {"root": root, "target": str(target), "train": str(train), "val": str(val), "config": str(path)}


def make_dm(s: dict, **overrides) -> DFlashDataModule:
    kwargs = dict(train_files=[s["train"]], val_files=[s["val"]], tokenizer=s["target"], token_budget=256,
                  max_documents=8, block_size=8)
    return DFlashDataModule(**(kwargs | overrides))


def cache_cli(s: dict, out: Path, *extra: str) -> None:
    cli_main(["cache", "--config", s["config"], "--out", str(out), "--shard_gb", SHARD_GB, *extra])


def shard_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {p.name: load_file(p) for p in sorted(folder.glob("*.safetensors"))}


def online_rows(s: dict, cache: FeatureCache, split: str, samples) -> list[tuple[list[int], torch.Tensor]]:
    """The target's float32 features of the rows the cache command ran: (documents, features [tokens, K*H])."""
    extractor = FeatureExtractor.from_pretrained(s["target"], LAYER_IDS, torch.float32)
    rows = fcw._ForwardRows(cache.manifest["splits"][split]["shards"], {split: samples}, 256)
    out = []
    for k in range(len(rows)):
        row = rows[k]
        out.append((rows.rows[k][2], extractor(row["input_ids"], row["position_ids"])))
    return out


def test_manifest_records_what_the_features_depend_on(setup):
    manifest = json.loads((setup["root"] / "bf16" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["feature_format"] == "bf16" and manifest["feature_dim"] == 64
    assert manifest["target"]["layer_ids"] == LAYER_IDS and manifest["target"]["hidden_size"] == 32
    assert manifest["data"] == {"format": "auto", "enable_thinking": None, "max_length": 256, "block_size": 8,
                                "min_supervised_tokens": 16, "on_bad_record": "error"}
    train = manifest["splits"]["train"]
    assert train["num_samples"] == 40 and len(train["shards"]) >= 3
    assert [s["first"] for s in train["shards"]][0] == 0 and train["shards"][-1]["end"] == 40
    assert [s["first"] for s in train["shards"]][1:] == [s["end"] for s in train["shards"]][:-1]
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in train["shards"])
    assert not list((setup["root"] / "bf16").glob("progress-*")) and not list((setup["root"] / "bf16").glob(".*"))


def test_bf16_cache_holds_the_target_features_bitwise(setup):
    dm = make_dm(setup)
    dm.setup("fit")
    cache = FeatureCache(setup["root"] / "bf16")
    for split, samples in (("train", dm.train_samples), ("val", dm.val_samples)):
        reader = cache.split(split)
        for docs, feats in online_rows(setup, cache, split, samples):
            start = 0
            for i in docs:
                stored = reader.document(i)
                n = stored["features"].shape[0]
                # exact: the cache is the target's output on the row it ran, rounded to bf16
                assert torch.equal(stored["features"], feats[start : start + n].bfloat16())
                assert torch.equal(stored["input_ids"], samples.document(i)[0])
                assert torch.equal(stored["loss_mask"], samples.document(i)[1])
                start += n


def test_forward_rows_have_one_length_and_their_padding_changes_no_feature(setup):
    """Every forward row has the same length (CUDA compiles the target's attention for fixed shapes); the padding,
    a document of its own after the real tokens, leaves their features as the unpadded row gives them."""
    dm = make_dm(setup)
    dm.setup("fit")
    cache = FeatureCache(setup["root"] / "bf16")
    rows = fcw._ForwardRows(cache.manifest["splits"]["train"]["shards"], {"train": dm.train_samples}, 256)
    assert {rows[k]["input_ids"].numel() for k in range(len(rows))} == {256}
    padded = [rows[k] for k in range(len(rows)) if rows[k]["tokens"] < 256][:2]
    assert padded
    extractor = FeatureExtractor.from_pretrained(setup["target"], LAYER_IDS, torch.float32)
    for row in padded:
        n = row["tokens"]
        torch.testing.assert_close(extractor(row["input_ids"], row["position_ids"])[:n],
                                   extractor(row["input_ids"][:n], row["position_ids"][:n]), rtol=1e-5, atol=1e-6)


def test_cache_with_final_hidden_states_round_trips_and_feeds_distillation(setup, tmp_path):
    """`model.objective: kl` stores the target's final hidden states (bf16) and a fit reads them back."""
    out = tmp_path / "kl"
    cache_cli(setup, out, "--model.objective=kl", "--format", "fp8")
    cache = FeatureCache(out)
    assert cache.manifest["final_hidden"] is True and not FeatureCache(setup["root"] / "fp8").manifest["final_hidden"]
    dm = make_dm(setup)
    dm.setup("fit")
    extractor = FeatureExtractor.from_pretrained(setup["target"], LAYER_IDS, torch.float32, final_hidden=True)
    reader = cache.split("train", final_hidden=True)
    rows = fcw._ForwardRows(cache.manifest["splits"]["train"]["shards"], {"train": dm.train_samples}, 256)
    for k in range(len(rows)):
        row = rows[k]
        final = extractor.extract(row["input_ids"], row["position_ids"])["final_hidden"]
        start = 0
        for i in rows.rows[k][2]:
            stored = reader.document(i)["final_hidden"]
            assert torch.equal(stored, final[start : start + stored.shape[0]].bfloat16())  # bf16 even in fp8
            start += stored.shape[0]
    batch = reader.packed(rows.rows[0][2], 256)
    n = sum(reader.document(i)["final_hidden"].shape[0] for i in rows.rows[0][2])
    assert batch["final_hidden"].shape == (256, 32) and (batch["final_hidden"][n:] == 0).all()
    cli = cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={out}", "--model.objective=kl",
                    "--trainer.max_steps=2", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2
    with pytest.raises(ConfigError, match="target.fp8: data.feature_cache .* serves stored features"):
        cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={out}", "--target.fp8=true",
                  "--target.dtype=bfloat16", f"--trainer.default_root_dir={tmp_path}"])
    with pytest.raises(FeatureCacheError, match=r"has no final_hidden \(the target's final hidden states\), which "
                                                r"model.objective 'kl' needs: .* --final_hidden true$"):
        cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={setup['root'] / 'bf16'}",
                  "--model.objective=kl", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"])


def test_fp8_cache_within_its_rounding_bound(setup):
    dm = make_dm(setup)
    dm.setup("fit")
    cache = FeatureCache(setup["root"] / "fp8")
    reader = cache.split("train")
    worst = 0.0
    for docs, feats in online_rows(setup, cache, "train", dm.train_samples):
        start = 0
        for i in docs:
            stored = reader.document(i)
            n = stored["features"].shape[0]
            x = feats[start : start + n]
            got = dequantize(stored["features"], stored["scales"])
            # e4m3 keeps 3 mantissa bits: error <= 2^-4 |x|, or half the subnormal step 2^-10 * scale near 0
            bound = x.abs() * 2**-4 + stored["scales"][:, None] * 2**-10 + 1e-7
            assert ((got - x).abs() <= bound).all()
            worst = max(worst, float(((got - x).abs() / x.abs().amax(-1, keepdim=True)).max()))
            start += n
    assert worst <= 2**-4


def test_quantize_fp8_edge_rows():
    x = torch.tensor([[0.0, 0.0], [448.0 * 3, -1.0], [1e-30, -2e-30]])
    values, scales = quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    out = dequantize(values, scales)
    assert torch.equal(out[0], torch.zeros(2)) and out[1, 0] == 448.0 * 3 and torch.isfinite(out).all()


class Record(Callback):
    """Losses and the batches (without features) that the training loop used."""

    def __init__(self) -> None:
        self.losses, self.batches, self.features = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append({k: v.clone() for k, v in batch.items() if k != "context_features"})
        self.features.append(batch["context_features"].float().clone())


class RoundedTargetFeatures(TargetFeatures):
    """Online features rounded to bf16, as the bf16 cache stores them."""

    def add_features(self, batch) -> None:
        super().add_features(batch)
        batch["context_features"] = batch["context_features"].bfloat16().float()


def wired(module: DFlashModule, **overrides) -> dict:
    """The data module's (or TargetFeatures') values that the CLI links from the module."""
    return {"target_layer_ids": module.drafter_config.target_layer_ids, "final_hidden": module.loss_settings.distills,
            **overrides}


def fit(setup: dict, feature_cache: str | None, online: type[TargetFeatures] | None = None) -> Record:
    seed_everything(0)
    record = Record()
    module = DFlashModule(setup["target"], DrafterConfig(num_layers=2, block_size=8), token_budget=256,
                          num_anchors=16, lr=3e-3)
    dm = make_dm(setup, feature_cache=feature_cache, **wired(module, target=setup["target"]))
    if online is not None:
        ids = module.drafter_config.target_layer_ids
        online = online(setup["target"], dtype="float32", layer_ids=ids, final_hidden=module.loss_settings.distills)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[record] + ([online] if online else []))
    trainer.fit(module, datamodule=dm)
    return record


def test_fit_from_cache_sees_the_same_batches_and_losses(setup):
    online = fit(setup, None, RoundedTargetFeatures)
    bf16 = fit(setup, str(setup["root"] / "bf16"))
    fp8 = fit(setup, str(setup["root"] / "fp8"))
    assert len(online.losses) == len(bf16.losses) == len(fp8.losses) == 5
    for a, b, c in zip(online.batches, bf16.batches, fp8.batches, strict=True):
        assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    # Online rows pack documents differently from the cache's target rows: float32 noise (~1e-7) can flip a
    # bf16 rounding, so features agree to one bf16 step on rare elements and losses to ~1e-5, not bitwise.
    for batch, x, y in zip(online.batches, online.features, bf16.features, strict=True):
        n = int(batch["doc_lengths"].sum())  # online, padding gets the target's output on pad ids; cached: zero
        assert (y[n:] == 0).all()
        torch.testing.assert_close(y[:n], x[:n], rtol=2**-7, atol=1e-6)
        assert (x[:n] != y[:n]).float().mean() < 1e-3
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(online.losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(fp8.losses), torch.tensor(online.losses), rtol=2e-2, atol=0)


def test_fit_from_cache_through_the_cli(setup, tmp_path, caplog):
    bf16 = str(setup["root"] / "bf16")
    cli = cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={bf16}", "--trainer.max_steps=2",
                    "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
                    f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2 and "val/loss" in cli.trainer.callback_metrics
    assert cli.datamodule._features.keys() == {"train", "val"}
    target = next(c for c in cli.trainer.callbacks if type(c).__name__ == "TargetFeatures")
    assert target.extractor is None and not target.extractors  # the cache serves features: no target is loaded


def test_interrupted_cache_run_resumes(setup, tmp_path, monkeypatch):
    out = tmp_path / "cache"
    real, calls = fcw.write_shard, []

    def failing(path, tensors, metadata):
        if len(calls) == 2:
            # a crash after the shard's temporary file was written, before its rename
            (path.parent / f".{path.name}.123.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        calls.append(path.name)
        return real(path, tensors, metadata)

    monkeypatch.setattr(fcw, "write_shard", failing)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        cache_cli(setup, out)
    with pytest.raises(FeatureCacheError, match=r"incomplete \(0 of 7 shards\)"):
        FeatureCache(out)  # the manifest is updated from the progress file on the next run
    kept = {name: (out / name).stat().st_mtime_ns for name in calls}
    monkeypatch.setattr(fcw, "write_shard", real)
    written = []
    monkeypatch.setattr(fcw, "write_shard", lambda p, t, m: written.append(p.name) or real(p, t, m))
    cache_cli(setup, out)
    assert sorted(written + calls) == sorted(p.name for p in (setup["root"] / "bf16").glob("*.safetensors"))
    assert {name: (out / name).stat().st_mtime_ns for name in calls} == kept  # finished shards are not redone
    assert not list(out.glob(".*.tmp")) and not list(out.glob("progress-*"))
    ref, got = shard_tensors(setup["root"] / "bf16"), shard_tensors(out)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[n][k], got[n][k]) for n in ref for k in ref[n])
    assert FeatureCache(out).manifest["complete"]
    written.clear()
    cache_cli(setup, out)  # nothing left to do
    assert written == []


def test_mismatched_cache_is_refused_naming_the_field(setup, tmp_path):
    bf16 = str(setup["root"] / "bf16")
    with pytest.raises(FeatureCacheError, match=r"data\.max_length is 256 in the cache and 200 here"):
        make_dm(setup, feature_cache=bf16, max_length=200).setup("fit")
    with pytest.raises(FeatureCacheError, match=r"data\.enable_thinking"):
        make_dm(setup, feature_cache=bf16, enable_thinking=False).setup("fit")
    with pytest.raises(FeatureCacheError, match=r"data\.min_supervised_tokens is 16 in the cache and 2 here"):
        make_dm(setup, feature_cache=bf16, min_supervised_tokens=2).setup("fit")
    changed = write_conversations(tmp_path / "train.jsonl", 40, seed=5)
    with pytest.raises(FeatureCacheError, match=r"splits\.train\.files_sha256 .* made from \['.*train\.jsonl'\]"):
        make_dm(setup, feature_cache=bf16, train_files=[str(changed)]).setup("fit")
    other = make_target(tmp_path / "other", layers=6, hidden=32, heads=2, kv_heads=1, seed=1)
    shutil.copy(Path(setup["target"]) / "tokenizer.json", other / "tokenizer.json")
    # the drafter in the trainer decides the target and layer ids the features must come from
    for target, drafter, error, field in (
            (setup["target"], DrafterConfig(num_layers=2, block_size=8, target_layer_ids=[0, 2]), FeatureCacheError,
             r"target\.layer_ids is \[1, 3\] in the cache and \[0, 2\] here"),
            (str(other), DrafterConfig(num_layers=2, block_size=8), TargetChangedError,
             f"feature cache {bf16} was made with other target weights than those of {other}")):
        module = DFlashModule(target, drafter, token_budget=256, num_anchors=16)
        trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
        with pytest.raises(error, match=field):
            trainer.fit(module, datamodule=make_dm(setup, feature_cache=bf16, **wired(module, target=target)))
    # a data module built by hand without the drafter's values is refused where it meets the module, by name
    with pytest.raises(ConfigError, match=r"^data\.target None differs from model\.target '.*': give both"):
        Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False).fit(
            module, datamodule=make_dm(setup, feature_cache=bf16))
    with pytest.raises(FeatureCacheError, match=r"feature_format is 'bf16' in the cache and 'fp8' here"):
        cache_cli(setup, Path(bf16), "--format", "fp8")
    with pytest.raises(FeatureCacheError, match="no manifest.json"):
        make_dm(setup, feature_cache=str(tmp_path)).setup("fit")


def test_a_cache_of_the_target_before_a_fine_tune_is_refused_unless_accepted(setup, tmp_path, caplog):
    """Same config and shapes, one weight moved: features of the old weights are refused in one line naming the cache
    and the target; `model.accept_target_change` reads them with one logged line; a cache without the fingerprint
    (an older version) is read with one logged line; a cache run does not resume with another target."""
    bf16 = str(setup["root"] / "bf16")
    tuned = fine_tune(Path(setup["target"]), tmp_path / "tuned")
    args = ["fit", "--config", setup["config"], f"--target.path={tuned}", "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(TargetChangedError) as err:
        cli_main([*args, f"--data.feature_cache={bf16}"])
    message = str(err.value)
    assert f"feature cache {bf16} was made with other target weights than those of {tuned}" in message
    assert "--model.accept_target_change=true" in message and "\n" not in message
    caplog.clear()
    cli = cli_main([*args, f"--data.feature_cache={bf16}", "--model.accept_target_change=true"])
    assert cli.trainer.global_step == 1
    accepted = [r.getMessage() for r in caplog.records if "as model.accept_target_change says" in r.getMessage()]
    assert len(accepted) == 1 and bf16 in accepted[0] and str(tuned) in accepted[0]

    old = tmp_path / "old"
    shutil.copytree(bf16, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["target"]["weights_fingerprint"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    cli_main([*args, f"--target.path={setup['target']}", f"--data.feature_cache={old}"])
    lines = [r.getMessage() for r in caplog.records if "records no content fingerprint" in r.getMessage()]
    assert len(lines) == 1 and str(old) in lines[0]

    partial = tmp_path / "partial"
    shutil.copytree(bf16, partial)
    with pytest.raises(FeatureCacheError, match=r"target\.weights_fingerprint is '[0-9a-f]{64}' in the cache"):
        cache_cli(setup, partial, f"--target.path={tuned}")


def test_cache_refuses_an_fp8_target_and_a_compiled_one_off_cuda(setup, tmp_path, monkeypatch):
    """The target's settings are honoured or refused, never ignored: FP8 features are not cached, compile is CUDA's."""
    loaded = []
    monkeypatch.setattr(FeatureExtractor, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError, match="target.fp8: the cache stores the features of the target in target.dtype"):
        cache_cli(setup, tmp_path / "fp8", "--target.fp8=true", "--target.dtype=bfloat16")
    with pytest.raises(ConfigError, match="target.compile: compiles the target's layers on CUDA GPUs, .* on cpu"):
        cache_cli(setup, tmp_path / "compiled", "--target.compile=true")
    assert not loaded


def test_damaged_shards_are_named(setup, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(setup["root"] / "bf16", folder)
    shard = folder / "train-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(FeatureCacheError, match=r"train-00001\.safetensors has \d+ bytes, the manifest records"):
        make_dm(setup, feature_cache=str(folder)).setup("fit")
    shard.write_bytes(b"\xff" * 8 + data[8:])  # same size, header length garbage
    with pytest.raises(FeatureCacheError, match=r"train-00001\.safetensors is corrupt: unreadable safetensors"):
        make_dm(setup, feature_cache=str(folder)).setup("fit")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit in the data: only a checksum sees it
    make_dm(setup, feature_cache=str(folder)).setup("fit")
    with pytest.raises(FeatureCacheError, match=r"train-00001\.safetensors is corrupt: its sha256 differs"):
        cache_cli(setup, folder, "--verify", "true")
    shard.write_bytes(data)
    cache_cli(setup, folder, "--verify", "true")


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_flipped_bytes_in_a_shard_are_refused_when_the_sample_is_read(setup, tmp_path, fmt):
    """Same size, valid header, one byte of one sample's features changed: its crc32 names the shard."""
    folder = tmp_path / "flipped"
    shutil.copytree(setup["root"] / fmt, folder)
    shard = folder / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin = 8 + n + json.loads(data[8 : 8 + n])["features"]["data_offsets"][0]
    data[begin + 5] ^= 0x10
    shard.write_bytes(bytes(data))
    dm = make_dm(setup, feature_cache=str(folder))
    dm.setup("fit")  # sizes and headers are fine: nothing is refused before a sample is read
    first = json.loads((folder / "manifest.json").read_text())["splits"]["train"]["shards"][1]["first"]
    features = dm._features["train"]
    features.document(first + 1)  # another sample of the same shard is intact
    with pytest.MonkeyPatch.context() as patch:  # and is checked once per process, not on every read
        patch.setattr(fc, "sample_crc32", lambda *a: pytest.fail("checked twice"))
        features.document(first + 1)
    with pytest.raises(FeatureCacheError, match=rf"train-00001\.safetensors is corrupt: sample {first} .*crc32"):
        features.packed([first], 256)
    with pytest.raises(FeatureCacheError, match=r"train-00001\.safetensors is corrupt"):
        for _ in dm.train_dataloader():  # the same check where training reads
            pass


def test_fp8_batches_are_dequantised_after_transfer(setup):
    dm = make_dm(setup, feature_cache=str(setup["root"] / "fp8"))
    dm.setup("fit")
    ref = make_dm(setup, feature_cache=str(setup["root"] / "bf16"))
    ref.setup("fit")
    for raw, want in zip(dm.train_dataloader(), ref.train_dataloader(), strict=True):
        assert raw["context_features_fp8"].dtype == torch.float8_e4m3fn and raw["context_scales"].shape == (256,)
        batch = dm.on_after_batch_transfer(raw, 0)
        assert "context_features_fp8" not in batch and batch["context_features"].shape == (256, 64)
        n = int(batch["doc_lengths"].sum())
        assert (batch["context_features"][n:] == 0).all() and (want["context_features"][n:] == 0).all()
        torch.testing.assert_close(batch["context_features"], want["context_features"].float(), rtol=0.07, atol=1e-2)


def test_few_mapped_shards_serve_the_same_batches(setup, monkeypatch):
    bf16 = str(setup["root"] / "bf16")
    dm = make_dm(setup, feature_cache=bf16)
    dm.setup("fit")
    want = list(dm.train_dataloader())
    monkeypatch.setattr(fc, "MAX_OPEN_SHARDS", 1)  # every shard switch unmaps the last one
    dm = make_dm(setup, feature_cache=bf16)
    dm.setup("fit")
    got = list(dm.train_dataloader())
    assert len(dm._features["train"]._open) == 1
    assert all(torch.equal(a[k], b[k]) for a, b in zip(want, got, strict=True) for k in a)
    dm = make_dm(setup, feature_cache=bf16, num_workers=2)  # workers map the shards themselves
    dm.setup("fit")
    got = list(dm.train_dataloader())
    assert all(torch.equal(a[k], b[k]) for a, b in zip(want, got, strict=True) for k in a)


def test_two_ranks_write_the_same_cache(setup, tmp_path):
    """Lightning's DDP on the CPU (gloo): rank 0 plans, each rank writes its shards, rank 0 merges the manifest."""
    dm = make_dm(setup)
    manifest = fcw.write_cache(dm, setup["target"], LAYER_IDS, 32, tmp_path / "ddp", "bf16", "float32",
                              shard_bytes=int(float(SHARD_GB) * 1e9),
                              trainer_kwargs={"accelerator": "cpu", "devices": 2, "strategy": "ddp_fork"})
    assert manifest["complete"]
    ref, got = shard_tensors(setup["root"] / "bf16"), shard_tensors(tmp_path / "ddp")
    assert ref.keys() == got.keys() and all(torch.equal(ref[n][k], got[n][k]) for n in ref for k in ref[n])
    assert [s["sha256"] for s in manifest["splits"]["train"]["shards"]] == [
        s["sha256"] for s in FeatureCache(setup["root"] / "bf16").manifest["splits"]["train"]["shards"]]


def part_weights(module) -> dict[str, torch.Tensor]:
    """Copies of the parameters of the drafter's parts (not the backbone's), by part and name."""
    return {f"{type(part).__name__}.{name}": p.detach().clone() for part in module.drafter.parts
            for name, p in part.named_parameters()}


def check_cache_trains_a_part_offline(setup: dict, tmp_path: Path, args: list[str], monkeypatch):
    """`cache` with a part that reads the target's final hidden state (`args` name its variant) stores them by
    default and a 2-step fit reads them and moves every weight of the variant's parts; a cache without them is
    refused in one line naming the variant that reads them and the flag that writes them. The fit's CLI."""
    from dflash_lightning.commands.cli import cli_main
    from dflash_lightning.data.feature_cache import FeatureCache, FeatureCacheError
    from dflash_lightning.module import DFlashModule

    out = tmp_path / "cache"
    cli_main(["cache", "--config", setup["config"], "--out", str(out), "--shard_gb", SHARD_GB, *args])
    assert FeatureCache(out).manifest["final_hidden"] is True
    before, on_fit_start = {}, DFlashModule.on_fit_start
    monkeypatch.setattr(DFlashModule, "on_fit_start",  # the weights the fit starts from, once the drafter is built
                        lambda module: (before.update(part_weights(module)), on_fit_start(module)))
    cli = cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={out}", *args,
                    "--trainer.max_steps=2", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2
    after = part_weights(cli.model)
    assert before and before.keys() == after.keys()
    assert not [name for name in after if torch.equal(before[name], after[name])], "weights the fit left as they were"
    (variant,) = [a.partition("=")[2] for a in args if a.startswith("--model.drafter.variant=")]
    with pytest.raises(FeatureCacheError, match=r"has no final_hidden \(the target's final hidden states\), which "
                                                rf"model.drafter.variant '{variant}' needs: .* --final_hidden true$"):
        cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={setup['root'] / 'bf16'}", *args,
                  "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path / 'b'}"])
    return cli


XPRESS_ARGS = ["--model.drafter.variant=xpress", "--model.loss_weights=decay", "--model.objective=ce",
               "--model.drafter.xpress.rank=16", "--model.drafter.xpress.mlp_hidden=64"]


def test_a_cache_written_for_xpress_holds_the_final_hidden_state_and_trains_it_offline(setup, tmp_path, monkeypatch):
    """XPress's loss distils the target's distribution (docs/method.md 14): `cache` stores the final hidden states for
    its config by default, a fit reads them and trains the refiner, a cache without them is refused naming the flag."""
    cli = check_cache_trains_a_part_offline(setup, tmp_path, XPRESS_ARGS, monkeypatch)
    assert cli.model.drafter.xpress_head.mix.L.abs().sum() > 0  # the refiner trained (its mixer starts at 0)


def test_domino_trains_from_a_cache_without_the_final_hidden_states(setup, tmp_path):
    """Domino reads the target's embedding and no final hidden state: a 2-step fit from the plain bf16 cache through
    the CLI, its curriculum over the Trainer's real total (lambda 1, then 0.5 at the second step)."""
    from dflash_lightning.commands.cli import cli_main

    cli = cli_main(["fit", "--config", setup["config"], f"--data.feature_cache={setup['root'] / 'bf16'}",
                    "--model.drafter.variant=domino", "--model.loss_weights=decay", "--model.metrics_every=1",
                    "--model.drafter.domino.gru_hidden_dim=8", "--model.drafter.domino.emb_dim=4",
                    "--trainer.max_steps=2", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2 and not cli.model.needs_final_hidden
    assert cli.trainer.callback_metrics["train/domino/lambda"].item() == 0.5

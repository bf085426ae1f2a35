"""save_checkpoint / load_checkpoint: round trips, exact optimizer continuation, index handling,
tampering, corruption, housekeeping."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt import _native
from fastckpt.checkpoint.api import list_checkpoints, load_checkpoint, prune, save_checkpoint
from fastckpt.checkpoint.specs import create_model_spec
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError, UntrustedTargetError
from fastckpt.format.records import seal_manifest

CALLS: list[str] = []


def must_not_run(*args: Any, **kwargs: Any) -> None:
    """A module-level function a tampered spec could name: records any call."""
    CALLS.append("called")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class MLP(nn.Module):
    def __init__(self, blocks: list[nn.Module], out: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(blocks[-1].width, out)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class FactoryNet(nn.Module):
    seen_devices: ClassVar[list[Any]] = []

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.linear = nn.Linear(width, 2)

    @classmethod
    def create(cls, width: int, device: Any = None) -> FactoryNet:
        cls.seen_devices.append(device)
        return cls(width).to(device or "cpu")


def mlp_and_spec() -> tuple[MLP, Any]:
    spec = create_model_spec(
        MLP, blocks=[create_model_spec(Block, width=4), create_model_spec(Block, width=4)], out=3
    )
    return spec.build(), spec


def same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=gen)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def test_linear_round_trip(tmp_path: Path) -> None:
    model = nn.Linear(5, 2)
    index = save_checkpoint(tmp_path, models={"main": (model, None)})
    assert index == 0
    result = load_checkpoint(tmp_path)
    restored = result["models"]["main"]["model"]
    assert isinstance(restored, nn.Linear) and same_params(model, restored)
    assert result["checkpoint_index"] == 0
    assert result["source"] == {"format": "fastckpt", "path": str(tmp_path / "0")}
    assert result["strategy"] is None


def test_nested_specs_and_factory_with_device(tmp_path: Path) -> None:
    mlp, spec = mlp_and_spec()
    factory_spec = create_model_spec(FactoryNet.create, width=3)
    net = factory_spec.build()
    save_checkpoint(tmp_path, models={"mlp": (mlp, spec), "net": (net, factory_spec)})
    FactoryNet.seen_devices.clear()
    result = load_checkpoint(tmp_path, map_location="cpu")
    assert same_params(mlp, result["models"]["mlp"]["model"])
    assert same_params(net, result["models"]["net"]["model"])
    # Built once on the meta device (checked against the checkpoint), then for real.
    assert FactoryNet.seen_devices == [torch.device("meta"), torch.device("cpu")]


def two_models_setup() -> dict[str, Any]:
    torch.manual_seed(0)
    enc, enc_spec = mlp_and_spec()
    head = nn.Linear(3, 4)
    sgd = torch.optim.SGD(enc.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(head.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=3, gamma=0.5)
    return {
        "enc": enc,
        "enc_spec": enc_spec,
        "head": head,
        "sgd": sgd,
        "adam": adam,
        "sched": sched,
    }


def joint_step(s: dict[str, Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=gen)
    s["sgd"].zero_grad()
    s["adam"].zero_grad()
    s["head"](s["enc"](x)).square().mean().backward()
    s["sgd"].step()
    s["adam"].step()
    s["sched"].step()


def test_two_models_two_optimizers_scheduler_continue_identically(tmp_path: Path) -> None:
    live = two_models_setup()
    for seed in range(5):
        joint_step(live, seed)
    save_checkpoint(
        tmp_path,
        models={"enc": (live["enc"], live["enc_spec"]), "head": (live["head"], None)},
        optimizers={"sgd": (live["sgd"], None), "adam": (live["adam"], None)},
        schedulers={"sched": (live["sched"], None)},
    )
    result = load_checkpoint(tmp_path)
    models = result["models"]
    assert set(models["enc"]["optimizers"]) == {"sgd"}
    assert set(models["head"]["optimizers"]) == {"adam"}
    assert set(models["head"]["schedulers"]) == {"sched"}
    restored = {
        "enc": models["enc"]["model"],
        "head": models["head"]["model"],
        "sgd": models["enc"]["optimizers"]["sgd"]["optimizer"],
        "adam": models["head"]["optimizers"]["adam"]["optimizer"],
        "sched": models["head"]["schedulers"]["sched"]["scheduler"],
    }
    assert same_params(live["enc"], restored["enc"])
    assert restored["sched"].get_last_lr() == live["sched"].get_last_lr()
    for seed in range(5, 15):
        joint_step(live, seed)
        joint_step(restored, seed)
        assert same_params(live["enc"], restored["enc"]), seed
        assert same_params(live["head"], restored["head"]), seed
    assert restored["adam"].param_groups[0]["lr"] == live["adam"].param_groups[0]["lr"]


def test_indices_latest_and_changed_component_sets(tmp_path: Path) -> None:
    models = [nn.Linear(2, 2) for _ in range(3)]
    for i, model in enumerate(models):
        extra = {"extra": (nn.Linear(1, 1), None)} if i == 2 else {}
        assert save_checkpoint(tmp_path, models={"main": (model, None), **extra}) == i
    assert load_checkpoint(tmp_path)["checkpoint_index"] == 2
    assert same_params(load_checkpoint(tmp_path, 0)["models"]["main"]["model"], models[0])
    assert set(load_checkpoint(tmp_path, 0)["models"]) == {"main"}
    assert set(load_checkpoint(tmp_path, 2)["models"]) == {"main", "extra"}
    only = load_checkpoint(tmp_path, 2, model_names=["extra"])
    assert set(only["models"]) == {"extra"}
    with pytest.raises(KeyError, match=r"available|has \['extra', 'main'\]"):
        load_checkpoint(tmp_path, model_names=["nope"])
    with pytest.raises(KeyError, match="available"):
        load_checkpoint(tmp_path, 7)
    # An explicit existing index is replaced.
    replacement = nn.Linear(2, 2)
    assert save_checkpoint(tmp_path, models={"main": (replacement, None)}, checkpoint_index=1) == 1
    assert same_params(load_checkpoint(tmp_path, 1)["models"]["main"]["model"], replacement)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "manifest.json"]


def test_validators_are_wrapped(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})

    def no_linear(model: nn.Module) -> None:
        raise AssertionError("linear models are not allowed")

    with pytest.raises(ValueError, match=r"no_linear.*'main'.*not allowed"):
        load_checkpoint(tmp_path, validators=[no_linear])


def test_ddp_is_unwrapped_and_fsdp_refused(tmp_path: Path) -> None:
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, module: nn.Module) -> None:  # no process group needed
            nn.Module.__init__(self)
            self.module = module

    inner = nn.Linear(2, 3)
    save_checkpoint(tmp_path, models={"main": (FakeDDP(inner), None)})
    keys = fastckpt.read_metadata(tmp_path / "0" / "models" / "main.safetensors")["tensors"]
    assert set(keys) == {"weight", "bias"}


def retarget_spec(root: Path, index: int, relpath: str, edit: dict[str, Any]) -> None:
    """Tamper with a JSON file *and* fix up the manifest, as a thorough attacker would."""
    path = root / str(index) / relpath
    document = json.loads(path.read_text())
    document.update(edit)
    data = json.dumps(document).encode()
    path.write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["checkpoints"][str(index)]["files"][relpath] = {
        "size": len(data),
        "crc32c": _native.crc32c(data),
    }
    (root / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))


@pytest.mark.parametrize(
    "target", ["subprocess.run", "os.system", "builtins.eval", f"{__name__}.must_not_run"]
)
def test_tampered_spec_is_refused_and_nothing_runs(tmp_path: Path, target: str) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
    retarget_spec(tmp_path, 0, "models/main.spec.json", {"cls_path": target, "kwargs": {}})
    CALLS.clear()
    with pytest.raises(UntrustedTargetError, match=re.escape(target)) as info:
        load_checkpoint(tmp_path)
    assert CALLS == []
    # The refusal names the file the path came from (before: the path only).
    assert str(info.value).startswith(f"{tmp_path}/0/models/main.spec.json: ")


def test_path_traversal_in_manifest_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["checkpoints"]["0"]
    entry["components"]["models"] = ["../../etc"]
    (tmp_path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(CheckpointFormatError, match=r"not a valid name"):
        load_checkpoint(tmp_path)
    entry["components"]["models"] = ["main"]
    entry["files"]["../escape.json"] = {"size": 1, "crc32c": 0}
    (tmp_path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(CheckpointFormatError):
        load_checkpoint(tmp_path)


def test_newer_schema_is_a_clear_error(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(CheckpointFormatError, match="newer fastckpt"):
        load_checkpoint(tmp_path)


def test_corrupt_and_missing_files_previous_index_still_loads(tmp_path: Path) -> None:
    first, second = nn.Linear(64, 64), nn.Linear(64, 64)
    save_checkpoint(tmp_path, models={"main": (first, None)})
    save_checkpoint(tmp_path, models={"main": (second, None)})
    weights = tmp_path / "1" / "models" / "main.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x20
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"main\.safetensors"):
        load_checkpoint(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"main\.safetensors"):
        load_checkpoint(tmp_path)
    assert same_params(load_checkpoint(tmp_path, 0)["models"]["main"]["model"], first)


def test_swapped_files_between_indices_are_detected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(8, 8), None)})
    save_checkpoint(tmp_path, models={"main": (nn.Linear(8, 8), None)})
    a = tmp_path / "0" / "models" / "main.safetensors"
    b = tmp_path / "1" / "models" / "main.safetensors"
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    with pytest.raises(ChecksumMismatchError, match="manifest"):
        load_checkpoint(tmp_path, 1)


def test_bad_components_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=r"not a valid name"):
        save_checkpoint(tmp_path, models={"../x": (nn.Linear(1, 1), None)})
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, models={"main": ("not a module", None)})
    assert not (tmp_path / "manifest.json").exists()
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_leftover_temp_dirs_are_cleaned_by_next_save(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(1, 1), None)})
    (tmp_path / ".tmp-1-999-dead").mkdir()
    (tmp_path / ".tmp-1-999-dead" / "junk").write_text("x")
    save_checkpoint(tmp_path, models={"main": (nn.Linear(1, 1), None)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "manifest.json"]


def test_list_and_prune(tmp_path: Path) -> None:
    for step in range(4):
        save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)}, counters={"step": step})
    listing = list_checkpoints(tmp_path)
    assert [c["index"] for c in listing] == [0, 1, 2, 3]
    assert [c["latest"] for c in listing] == [False, False, False, True]
    assert listing[2]["counters"] == {"step": 2}
    assert all(c["size"] > 0 for c in listing)
    assert prune(tmp_path, keep_last=2) == [0, 1]
    assert [c["index"] for c in list_checkpoints(tmp_path)] == [2, 3]
    assert not (tmp_path / "0").exists()
    with pytest.raises(ValueError):
        prune(tmp_path, keep_last=0)
    assert load_checkpoint(tmp_path)["checkpoint_index"] == 3


def test_no_module_uses_pickle_for_loading() -> None:
    package = Path(fastckpt.__file__).parent
    offenders = []
    for source in package.rglob("*.py"):
        text = source.read_text()
        if re.search(r"^\s*(import pickle|from pickle|import dill|import cloudpickle)", text, re.M):
            offenders.append(source.name)
        if re.search(r"torch\.load\((?![^)]*weights_only=True)", text):
            offenders.append(f"{source.name} (torch.load without weights_only)")
    assert offenders == []


def test_saves_and_loads_are_logged_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="fastckpt"):
        save_checkpoint(tmp_path, models={"main": (nn.Linear(4, 4), None)})
        load_checkpoint(tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("fastckpt")]
    assert any(m.startswith("saved ") and "GiB/s" in m for m in messages), messages
    assert any(m.startswith("loaded ") and "GiB/s" in m for m in messages), messages


def test_adamw_defaults_rebuild(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, models={"main": (model, None)}, optimizers={"w": (optimizer, None)})
    restored = load_checkpoint(tmp_path)["models"]["main"]["optimizers"]["w"]["optimizer"]
    assert isinstance(restored, torch.optim.AdamW)
    assert restored.param_groups[0]["weight_decay"] == 0.1


def test_tampered_spec_cannot_import_arbitrary_modules(tmp_path: Path) -> None:
    import sys

    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
    retarget_spec(tmp_path, 0, "models/main.spec.json", {"cls_path": "this.Model", "kwargs": {}})
    sys.modules.pop("this", None)  # the module prints the Zen of Python when imported
    with pytest.raises(UntrustedTargetError, match="not imported in this process"):
        load_checkpoint(tmp_path)
    assert "this" not in sys.modules


@pytest.mark.parametrize("keep_last", [1.5, "1", True])
def test_prune_refuses_a_keep_last_that_is_not_an_int(tmp_path: Path, keep_last: Any) -> None:
    """``keep_last=True`` pruned to one index (and 1.5 / "1" died on a slice or a comparison):
    a TypeError naming the argument, nothing deleted."""
    model = torch.nn.Linear(2, 2)
    for _ in range(3):
        fastckpt.save_checkpoint(tmp_path, models={"m": model})
    with pytest.raises(TypeError, match="keep_last must be an int"):
        fastckpt.prune(tmp_path, keep_last=keep_last)
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path)] == [0, 1, 2]


def test_prune_of_a_missing_root_names_the_root(tmp_path: Path) -> None:
    """Before: a FileNotFoundError naming ``<root>/.fastckpt.lock``."""
    with pytest.raises(FileNotFoundError, match="no checkpoint root here") as info:
        fastckpt.prune(tmp_path / "nowhere", keep_last=1)
    assert info.value.filename == str(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()


class WithExtra(torch.nn.Linear):
    """A Linear whose ``get_extra_state()`` is a dict."""

    def get_extra_state(self) -> Any:
        return {"calls": 3}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_a_model_with_non_tensor_extra_state_is_refused_when_saved(tmp_path: Path) -> None:
    """A module whose ``get_extra_state()`` returns a dict: refused at once with a TypeError
    naming the model, the entry and the way out (before: an ``InvalidInputError`` about
    ``'_extra_state'`` from the writer thread); nothing is committed."""
    with pytest.raises(TypeError, match=r"model 'main': its state_dict entry '_extra_state'"):
        fastckpt.save_checkpoint(tmp_path, models={"main": WithExtra(2, 2)})
    assert fastckpt.list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("value", [float("nan"), 1.5, True, "3"])
def test_counters_that_are_not_whole_numbers_are_refused(tmp_path: Path, value: Any) -> None:
    """``counters=`` holds whole numbers: anything else is a ``TypeError`` naming the
    counter and nothing is saved (before: NaN was written into manifest.json as the bare
    token ``NaN``, which strict JSON parsers refuse, and 1.5 or True were kept)."""
    model = nn.Linear(1, 1)
    with pytest.raises(TypeError, match="counters\\['loss'\\]"):
        save_checkpoint(tmp_path, models={"main": (model, None)}, counters={"loss": value})
    assert not (tmp_path / "manifest.json").exists()
    save_checkpoint(tmp_path, models={"main": (model, None)}, counters={"step": 2**40})
    assert load_checkpoint(tmp_path)["manifest"]["counters"] == {"step": 2**40}


def test_a_root_and_manager_checkpoints_never_share_a_folder(tmp_path: Path) -> None:
    """save_checkpoint into a CheckpointManager checkpoint (or a folder holding one) wrote a
    root there: the checkpoint's next save deleted the root, and ``verify`` of the folder
    checked the root only (a damaged manager checkpoint there verified ok)."""
    from fastckpt.container.verify import verify
    from fastckpt.errors import NotACheckpointError

    model = nn.Linear(2, 2)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "mgr" / "s1", {"a": torch.ones(1)})
    for root, needle in ((tmp_path / "mgr" / "s1", "commit.json"), (tmp_path / "mgr", "s1")):
        with pytest.raises(NotACheckpointError, match=needle):
            save_checkpoint(root, models={"main": (model, None)})
    assert sorted(p.name for p in (tmp_path / "mgr").iterdir()) == ["s1"]
    assert sorted(p.name for p in (tmp_path / "mgr" / "s1").iterdir()) == [
        "a.json",
        "a.safetensors",
        "commit.json",
    ]
    # A folder that holds both records (an earlier version wrote it) is neither kind.
    save_checkpoint(tmp_path / "root", models={"main": (model, None)})
    (tmp_path / "root" / "commit.json").write_bytes((tmp_path / "mgr/s1/commit.json").read_bytes())
    report = verify(tmp_path / "root")
    assert not report.ok and "both manifest.json" in report.failures[0].message
    with pytest.raises(CheckpointFormatError, match=r"both manifest\.json .* and commit\.json"):
        fastckpt.safe_open(tmp_path / "root")
    # An item named "manifest" would write manifest.json into a manager checkpoint.
    with (
        fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m,
        pytest.raises(CheckpointFormatError, match="reserved"),
    ):
        m.save(tmp_path / "mgr" / "s2", {"manifest": {"a": 1}})


def test_a_save_leaves_the_saved_tensors_storages_resizable(tmp_path: Path) -> None:
    # Before: the writer and the incremental digests exported live tensors with
    # Tensor.numpy(), which torch answers by marking the storage not resizable for good;
    # code freeing a parameter's storage (FSDP1-style flat parameters, offloading) with
    # untyped_storage().resize_(0) then failed after the first checkpoint.
    model = torch.nn.Linear(16, 16)
    fastckpt.save_checkpoint(tmp_path / "root", models={"m": (model, None)})
    fastckpt.save_checkpoint(tmp_path / "root", models={"m": (model, None)})  # incremental
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "mgr", {"model": model.state_dict()})
        template = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        m.load(tmp_path / "mgr", into=template)
    for tensor in [*model.state_dict().values(), *template["model"].values()]:
        assert tensor.untyped_storage().resizable()
    model.weight.untyped_storage().resize_(0)  # frees it, as such code does


def test_a_spec_nested_past_what_loads_read_is_a_format_error(tmp_path: Path) -> None:
    """Before: a spec argument nested 500 lists deep (a 2 KB edit) made load_checkpoint
    raise a bare RecursionError, and ``fastckpt inspect`` crash at 400 levels with a
    traceback and exit 1 ("damage found")."""
    import subprocess
    import sys

    from fastckpt.format.records import MAX_JSON_DEPTH

    model, spec = mlp_and_spec()
    save_checkpoint(tmp_path, models={"main": (model, spec)})
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH + 300):
        deep = [deep]
    spec_json = json.loads((tmp_path / "0" / "models" / "main.spec.json").read_text())
    retarget_spec(
        tmp_path, 0, "models/main.spec.json", {"kwargs": {**spec_json["kwargs"], "x": deep}}
    )
    with pytest.raises(CheckpointFormatError, match=r"main\.spec\.json: .*nested more than"):
        load_checkpoint(tmp_path)
    cli = subprocess.run(
        [sys.executable, "-m", "fastckpt", "inspect", str(tmp_path)], capture_output=True, text=True
    )
    assert (
        cli.returncode == 2 and "nested more than" in cli.stderr and "Traceback" not in cli.stderr
    )


def test_a_spec_naming_a_fastckpt_integration_imports_no_framework(tmp_path: Path) -> None:
    """fastckpt's own modules may be imported to resolve a spec, but not its integrations:
    before, ``fastckpt.integrations.lightning.Nope`` imported Lightning (torchmetrics,
    matplotlib, ...) and ran their import-time code, then failed with a bare ImportError."""
    import subprocess
    import sys

    model, spec = mlp_and_spec()
    save_checkpoint(tmp_path, models={"main": (model, spec)})
    retarget_spec(
        tmp_path, 0, "models/main.spec.json", {"cls_path": "fastckpt.integrations.lightning.Nope"}
    )
    code = (
        "import sys, fastckpt\n"
        "try:\n"
        f"    fastckpt.load_checkpoint({str(tmp_path)!r})\n"
        "except fastckpt.UntrustedTargetError as err:\n"
        "    print('refused', 'main.spec.json' in str(err))\n"
        "print('lightning' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["refused", "True", "False"], out


def test_refused_or_vanished_classes_name_the_file_that_records_them(tmp_path: Path) -> None:
    """Before: a model class gone since the save (renamed in a refactor) was a bare
    ImportError, and a refused optimizer or scheduler class an UntrustedTargetError naming no
    file."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)

    def fresh() -> None:
        save_checkpoint(
            tmp_path,
            models={"main": (model, None)},
            optimizers={"opt": (optimizer, None)},
            schedulers={"sch": (scheduler, None)},
            checkpoint_index=0,
        )

    fresh()
    retarget_spec(tmp_path, 0, "models/main.spec.json", {"cls_path": "torch.nn.NoSuchLayer"})
    with pytest.raises(CheckpointFormatError, match=r"0/models/main\.spec\.json: .*NoSuchLayer"):
        load_checkpoint(tmp_path)
    for relpath, path, error in (
        ("optimizers/opt.json", "os.system", UntrustedTargetError),
        ("schedulers/sch.json", "torch.optim.sgd.SGD", UntrustedTargetError),
        ("optimizers/opt.json", "torch.optim.NoSuchOptimizer", CheckpointFormatError),
    ):
        fresh()
        document = json.loads((tmp_path / "0" / relpath).read_text())
        retarget_spec(tmp_path, 0, relpath, {"spec": {**document["spec"], "cls_path": path}})
        with pytest.raises(error, match=rf"0/{re.escape(relpath)}: .*{re.escape(path)}"):
            load_checkpoint(tmp_path)


def test_trusted_entries_are_checked_like_registrations(tmp_path: Path) -> None:
    """Before: ``trusted=["not a path!"]`` was accepted and ignored (``register_trusted``
    refuses it), and ``trusted=5`` was "'int' object is not iterable"."""
    model, spec = mlp_and_spec()
    save_checkpoint(tmp_path, models={"main": (model, spec)})
    with pytest.raises(ValueError, match="'not a path!' is not a dotted path"):
        load_checkpoint(tmp_path, trusted=["not a path!"])
    with pytest.raises(TypeError, match="trusted= must be dotted paths or callables"):
        load_checkpoint(tmp_path, trusted=5)  # type: ignore[arg-type]
    assert load_checkpoint(tmp_path, trusted=["torch.nn.Linear"])["models"]["main"]

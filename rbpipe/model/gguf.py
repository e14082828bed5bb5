"""``--model FILE.gguf``: a GGUF checkpoint, dequantized once into a plain Hugging Face directory that every
process then loads.

Why a converted copy: transformers' GGUF loader dequantizes the whole file on every load (seconds
even for a small model), and a run loads its model in the launcher (the up-front check), the service, each
collector and the learner; and a GGUF-loaded model cannot ``save_pretrained``. The first load rebuilds it as a
plain model (the same class, its config without the quantization entry, the dequantized state dict) and writes
it, with its tokenizer and generation config, to a directory keyed by the file's path, size and modification
time under :func:`cache_root`; every later load, in any process, reads that directory, much faster (figures:
docs/DESIGN.md, Figures behind code choices). A conversion runs under a file lock and lands by rename, so processes that
start together convert once and never read half a directory. Needs the ``gguf`` extra (``pip install -e ".[gguf]"``:
``gguf`` and ``accelerate``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from rbpipe.errors import ConfigError
from rbpipe.system.fsutil import file_lock

SUFFIX = ".gguf"
#: written last into a converted directory: its presence means the conversion finished
DONE = "rbpipe-converted.json"
EXTRA_HINT = 'install the extra: pip install -e ".[gguf]" (the gguf and accelerate packages)'


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(SUFFIX)


def cache_root() -> Path:
    """``$RBPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rbpipe``, else ``~/.cache/rbpipe``."""
    if os.environ.get("RBPIPE_CACHE_DIR"):
        return Path(os.environ["RBPIPE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rbpipe"


def converted_dir(path: Path) -> Path:
    """Where the plain copy of ``path`` lives: a new file (or a changed one) gets a new directory."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def architecture(path: Path) -> str:
    """The file's ``general.architecture`` (read from its header; the tensors stay on disk)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(f"--model {path}: reading a GGUF file needs the gguf package; {EXTRA_HINT}") from None
    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file raises anything
        raise ConfigError(f"--model {path}: not a readable GGUF file ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}); pass a .gguf model file") from None


def check_supported(path: Path) -> str:
    """The architecture, or a one-line error when this transformers cannot load it as a causal LM."""
    arch = architecture(path)
    try:
        import accelerate  # noqa: F401 - transformers' GGUF loader needs it
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        raise ConfigError(f"--model {path}: loading a GGUF file needs accelerate; {EXTRA_HINT}") from None
    names = {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")}
    if not names & set(GGUF_SUPPORTED_ARCHITECTURES) or arch.startswith("t5"):
        raise ConfigError(f"--model {path}: GGUF architecture {arch!r} is not one transformers loads as a causal "
                          f"LM (it loads: {', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 't5'))}); "
                          "convert the model to a Hugging Face directory instead")
    return arch


def ensure_converted(path: str | Path) -> Path:
    """The plain directory of the GGUF file ``path``, converting it first if no process has yet."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such file; pass a .gguf file or a save_pretrained() directory")
    target = converted_dir(path)
    if (target / DONE).is_file():
        return target
    check_supported(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(target.name + ".lock")):
        if not (target / DONE).is_file():  # another process may have converted it while this one waited
            _convert(path, target)
    return target


def _convert(path: Path, target: Path) -> None:
    import json

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    what = "model"
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        what = "tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # noqa: BLE001 - transformers raises many types; all mean "not loadable"
        raise ConfigError(f"--model {path}: transformers cannot load this GGUF {what} ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a plain model: nothing left of the GGUF quantizer
        del config.quantization_config
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep the shared cache from other users
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE).write_text(json.dumps({"source": str(path.resolve()), "size": path.stat().st_size}))
        shutil.rmtree(target, ignore_errors=True)  # a conversion cut off before its rename left nothing usable
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""The run folder (--out-dir): what train.py checks and writes there before any model is loaded.

A run never destroys or mixes another, and bad input stops it at start, with an error naming the
folder, file or flag, not minutes later inside a model load or at the first checkpoint:
* a folder that already holds a run is refused unless --resume continues it or --overwrite
  replaces it; --overwrite removes only what train.py writes (RUN_ARTIFACTS), never the folder
  itself or files it does not know;
* the folder is probed for writing, so a read-only mount or a full disk fails now;
* the resolved config is kept beside the metrics (config.json), written atomically;
* the embedded tiny model remembers the settings it was built with: other settings rebuild it
  (or, on --resume, are an error: the checkpoint would not fit), and it is built in a temporary
  folder then renamed, so a kill mid-write never leaves a folder that a later start trusts.

Plain file work, no torch: train.prepare_run calls these on the right ranks, in order.
"""
import contextlib
import fnmatch
import importlib.util
import json
import os
import shutil

RUN_MARKERS = ("metrics.jsonl", "config.json", "checkpoints")
"""A folder holding any of these holds a run."""
RUN_ARTIFACTS = ("metrics.jsonl", "metrics.jsonl.tmp", "config.json", "config.json.tmp", "checkpoints",
                 "samples_step*.txt", "curve.png", "hf", "hf_step_[0-9]*", "tiny_model", "tiny_model.tmp", "tb")
"""Everything train.py writes into out_dir (glob patterns): all that --overwrite removes."""
TINY_SETTINGS = "build_settings.json"
"""Inside the tiny model's folder: the build_tiny_model arguments it was built with, written last."""
OPTIONAL_PACKAGES = {"--tensorboard": ("tensorboard", "tensorboard"), "--wandb": ("wandb", "wandb")}
"""flag: (module it imports, pip package that provides it)."""


def check_optional_packages(flags):
    """Raise naming each flag in `flags` (e.g. ["--wandb"]) whose package is not installed, and the
    pip install that fixes it — at start, not when the logger first imports it."""
    missing = [(flag, *OPTIONAL_PACKAGES[flag]) for flag in flags
               if importlib.util.find_spec(OPTIONAL_PACKAGES[flag][0]) is None]
    if missing:
        raise ModuleNotFoundError("; ".join(f"{flag} needs the {module} package, which is not installed: "
                                            f"pip install {pip}" for flag, module, pip in missing))


def probe_writable(out_dir, name=".write_probe"):
    """Create out_dir, write and fsync a small file there, remove it. A read-only mount, a missing
    permission or a full disk raises OSError naming the folder (give each rank its own `name`)."""
    path = os.path.join(out_dir, name)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)  # one page: a full tmpfs refuses even that
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)
    except OSError as e:
        with contextlib.suppress(OSError):  # the probe may never have been created
            os.remove(path)
        raise OSError(e.errno, f"cannot write to the run folder {out_dir} ({e.strerror or e}; "
                               f"{free_bytes(out_dir)} bytes free there): check --out-dir, its "
                               f"permissions and its disk") from e


def free_bytes(path):
    """Free bytes on the disk that holds `path` (or its nearest existing parent); -1 if unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:  # only ever part of an error message, which must not fail in turn
        return -1


def holds_run(out_dir):
    return any(os.path.exists(os.path.join(out_dir, m)) for m in RUN_MARKERS)


def prepare_out_dir(out_dir, resume, overwrite):
    """Refuse an out_dir that holds a run unless `resume` (continue it) or `overwrite` (remove its
    artifacts first). Returns the names removed."""
    if overwrite:
        return remove_run(out_dir)
    if not resume and holds_run(out_dir):
        found = [m for m in RUN_MARKERS if os.path.exists(os.path.join(out_dir, m))]
        raise FileExistsError(f"{out_dir} already holds a run ({', '.join(found)}): pass --resume to "
                              f"continue it, or --overwrite to replace it (removes only what train.py "
                              f"writes there), or choose another --out-dir")
    return []


def remove_run(out_dir):
    """Delete the RUN_ARTIFACTS in out_dir; the folder and any other file stay. Returns their names."""
    if not os.path.isdir(out_dir):
        return []
    removed = sorted(n for n in os.listdir(out_dir) if any(fnmatch.fnmatchcase(n, p) for p in RUN_ARTIFACTS))
    for name in removed:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return removed


def write_json_atomic(path, data):
    """Write `data` to a temporary file beside `path`, fsync, rename: `path` is old or new, never half."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_config(out_dir, config):
    """The resolved config (a dict of the Config fields) as out_dir/config.json."""
    return write_json_atomic(os.path.join(out_dir, "config.json"), config)


def tiny_model_settings(path):
    """The settings the tiny model at `path` was built with; None if absent or half-written."""
    try:
        with open(os.path.join(path, TINY_SETTINGS)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def ensure_tiny_model(path, settings, resume, build):
    """The embedded tiny model at `path`, built by build(folder, **settings) unless it already was
    with these settings. A model built with other settings is rebuilt, or with `resume` is an error
    (the checkpoint holds that model's weights). Built into path + ".tmp", then renamed. Returns path."""
    built = tiny_model_settings(path)
    if built == settings:
        return path
    if resume and built is not None:
        diff = ", ".join(f"{k} {built.get(k)} (now {settings.get(k)})"
                         for k in sorted(set(built) | set(settings)) if built.get(k) != settings.get(k))
        raise ValueError(f"--resume: the tiny model in {path} was built with {diff}; the checkpoint to "
                         f"resume holds that model. Pass the flags it was trained with (--tiny-hidden, "
                         f"--tiny-layers, --tiny-heads, --seed), or start a new run")
    tmp = path + ".tmp"
    if os.path.exists(tmp):  # left by a start killed mid-build
        shutil.rmtree(tmp)
    build(tmp, **settings)
    write_json_atomic(os.path.join(tmp, TINY_SETTINGS), settings)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path

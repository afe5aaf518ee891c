"""Models from the Hugging Face Hub: which files a checkpoint needs, fetched into the HF cache.

A repo id (`user/repo`, or `user/repo@REVISION`) resolves to a snapshot folder of the standard
Hugging Face cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE honoured).
Only what loading reads is fetched: config.json, the tokenizer files, generation_config.json,
pocket.json, and the weights named by `model.safetensors.index.json` (or a single
`model.safetensors`); a stray `consolidated.safetensors` or `.bin`/`.gguf` copy is never
downloaded. The local loader picks the same files (`weight_files`), so what is fetched is what
is loaded.

The cache is looked at first and a complete snapshot is used without any request or output;
otherwise the missing files are downloaded with byte progress on stderr. Every Hub failure
becomes one `PocketError` line that says what to do.

huggingface_hub is imported inside the functions that need it: its import costs ~0.14 s, which
the start-up of a local model should not pay.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TextIO

from pocket_mlx import units
from pocket_mlx.config import INDEX, METADATA_FILES, pick_weights, read_index, weight_files
from pocket_mlx.errors import PocketError
from pocket_mlx.progress import progress

TOKENIZERS = ("tokenizer.json", "tokenizer.model")
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.][\w./-]*))?$")
LOGIN = "log in with `hf auth login` or set HF_TOKEN"


# -- repo ids -------------------------------------------------------------------------------
def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """(repo, revision) of `user/repo[@revision]`, or None when `text` is not a repo id."""
    m = REPO_ID.match(text)
    if m is None or text.startswith((".", "/")):
        return None
    return m["repo"], m["rev"]


# -- errors ---------------------------------------------------------------------------------
def _network_errors() -> tuple[type[BaseException], ...]:
    """What a broken connection raises: OSError covers requests (huggingface_hub < 1) and the
    Hub's own HTTP errors; httpx (1.x) and httpx2 (2.x) transport errors are not OSErrors."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _reason(e: BaseException) -> str:
    """The innermost cause's first line ("[Errno 111] Connection refused"), not the wrapper's
    paragraph."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _hub_error(e: BaseException, repo: str, revision: str | None,
               what: str | None) -> PocketError:
    """One line for a failure while fetching file `what` (None: the repo's file list)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return PocketError(f"{repo} is gated on the Hub: accept its terms at "
                           f"{constants.ENDPOINT}/{repo} with your account, then {LOGIN}")
    if isinstance(e, RepositoryNotFoundError):
        return PocketError(f"repository {repo} not found on the Hub (or it is private/gated: "
                           f"{LOGIN})")
    if isinstance(e, RevisionNotFoundError):
        return PocketError(f"revision {revision!r} not found in {repo} on the Hub; pass an "
                           f"existing branch, tag or commit as {repo}@REVISION")
    if isinstance(e, DisabledRepoError):
        return PocketError(f"repository {repo} is disabled on the Hub")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return PocketError(f"the Hub refused access to {what or 'the files'} of {repo} "
                           f"(HTTP {status}); "
                           f"check your token: {LOGIN}")
    how = f"HTTP {status}" if isinstance(e, HfHubHTTPError) and status else _reason(e)
    if what is None:
        return PocketError(f"cannot get the file list of {repo} from {constants.ENDPOINT} "
                           f"({how}); check the connection and rerun, or set HF_HUB_OFFLINE=1 "
                           "to use only the cache")
    return PocketError(f"downloading {what} of {repo} failed ({how}); rerun the same command "
                       "to continue: finished files are kept")


@contextmanager
def _quiet_hub_logs():
    """huggingface_hub logs a warning per retry of a broken download; the outcome is reported
    as one line by `_hub_error`, so hold its logs at ERROR while fetching."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# -- progress -------------------------------------------------------------------------------
class DownloadProgress:
    """Bytes downloaded over all files of one fetch, shown by the one progress helper
    (pocket_mlx.progress: a bar on a terminal, plain lines every $POCKET_MLX_PROGRESS_INTERVAL
    seconds in a pipe or a file), after one line that says what is coming."""

    def __init__(self, repo: str, total: int, n_files: int, stream: TextIO | None = None):
        stream = stream or sys.stderr
        stream.write(f"downloading {repo}: {n_files} file{'s' * (n_files != 1)}, "
                     f"{units.size(total)}\n")
        stream.flush()
        self.bar = progress(total=total or None, desc=f"downloading {repo}", unit="B",
                            unit_scale=True, file=stream)

    def start(self, name: str) -> None:
        self.bar.set_postfix_str(name)

    def advance(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        """The closing line when every byte came; a failed download's error follows alone."""
        self.bar.close()

    def bar_class(self, name: str) -> type:
        """The `tqdm_class` for one file: its byte counts come here."""
        return _tqdm_like(lambda total: self.start(name), self.advance)


def _tqdm_like(start: Callable[[int | None], None], advance: Callable[[int], None]) -> type:
    """A stand-in for tqdm that huggingface_hub drives for one file (its `tqdm_class`): what it
    is told goes to `start(total)` and `advance(bytes)`, and it draws nothing itself."""

    class _FileBar:
        def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs):
            self.total, self.n = total, 0
            start(total)
            if initial:
                self.update(initial)

        def update(self, n: float | None = 1) -> None:
            n = int(n or 0)
            self.n += n
            advance(n)

        def update_transfer(self, n: float | None = 1) -> None:
            """Network bytes (Xet): the written bytes of `update` already count them."""

        def set_postfix_str(self, *args, **kwargs) -> None:
            pass

        set_transfer_postfix_str = set_postfix_str

        def refresh(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    return _FileBar


# huggingface_hub's own bars stay off: the index is fetched before the total is known, and
# HF_HUB_DISABLE_PROGRESS_BARS=1 turns ours off.
_SILENT = _tqdm_like(lambda total: None, lambda n: None)


# -- the cache ------------------------------------------------------------------------------
def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The snapshot folder of `repo` at `revision` when everything loading needs is in the
    cache (config, a tokenizer, every weight file), else None. No network.

    Downloads fetch the weights last, so a snapshot with all its weights also has the small
    files that exist in the repo."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    snap = Path(config).parent
    if not any((snap / t).is_file() for t in TOKENIZERS):
        return None
    try:
        files = weight_files(snap)
    except PocketError:  # an index whose shards are not all here yet
        return None
    return snap if files else None


def _write_ref(snapshot: Path, revision: str, commit: str) -> None:
    """Record `revision -> commit` in the cache's refs/ (its documented layout), so the next run
    finds the snapshot by branch or tag name without asking the Hub. Written then renamed."""
    if revision == commit:
        return
    ref = snapshot.parents[1] / "refs" / revision
    tmp = ref.with_name(f".{ref.name}.tmp-{os.getpid()}")
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(commit)
        tmp.replace(ref)
    except OSError:  # best effort, as huggingface_hub's own: the next run asks the Hub again
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


# -- fetching -------------------------------------------------------------------------------
def _offline() -> bool:
    from huggingface_hub import constants

    is_offline = getattr(constants, "is_offline_mode", None)  # huggingface_hub >= 1.0
    return bool(is_offline() if is_offline else constants.HF_HUB_OFFLINE)


def fetch(repo: str, revision: str | None = None, stream: TextIO | None = None) -> Path:
    """The local snapshot folder of a Hub model, downloading what is missing. Silent (and
    without any request) when the cache already holds everything."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    at = f"@{revision}" if revision else ""
    try:
        snap = cached_snapshot(repo, revision)
    except HFValidationError as e:  # the Hub's own rules on names ("--", "..", length)
        raise PocketError(f"no such model folder: {repo}{at}; nor is it a valid Hugging Face "
                          f"repo id ({_reason(e)})") from None
    if snap is not None:
        return snap
    if _offline():
        partly = os.path.isdir(Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}")
        state = "only partly in the cache" if partly else "not in the cache"
        raise PocketError(f"offline (HF_HUB_OFFLINE=1) and {repo}{at} is {state} "
                          f"({constants.HF_HUB_CACHE}); unset HF_HUB_OFFLINE to download it")
    with _quiet_hub_logs():
        return _download(repo, revision, stream)


def _download(repo: str, revision: str | None, stream: TextIO | None) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache

    wanted_rev = revision or constants.DEFAULT_REVISION
    network = _network_errors()
    try:
        info = HfApi().model_info(repo, revision=wanted_rev, files_metadata=True)
    except network as e:
        raise _hub_error(e, repo, revision, None) from None
    commit = info.sha or wanted_rev
    sizes = {s.rfilename: s.size for s in (info.siblings or [])}
    if "config.json" not in sizes:
        raise PocketError(f"{repo} has no config.json on the Hub; is it a model repository?")
    if not any(t in sizes for t in TOKENIZERS):
        raise PocketError(f"{repo} has no tokenizer.json or tokenizer.model on the Hub")

    def get(name: str, shown: DownloadProgress | None = None) -> Path:
        bar = shown.bar_class(name) if shown else _SILENT
        try:
            return Path(hf_hub_download(repo, name, revision=commit, tqdm_class=bar))
        except network as e:
            raise _hub_error(e, repo, revision, name) from None

    def cached(name: str) -> bool:
        return isinstance(try_to_load_from_cache(repo, name, revision=commit), str)

    # The index first (small, and it names the rest), then the small files, weights last:
    # `cached_snapshot` relies on that order.
    index = None
    if INDEX in sizes:
        index = read_index(get(INDEX))
    weights = pick_weights(sizes, index, f"{repo}/{INDEX}")
    if not weights:
        raise PocketError(f"{repo} has no safetensors weights on the Hub (pocket-mlx reads "
                          "model.safetensors or the shards of model.safetensors.index.json)")
    if missing := [w for w in weights if w not in sizes]:
        raise PocketError(f"{repo}/{INDEX} names {missing[0]}, which the repository does not "
                          "have")
    todo = [n for n in METADATA_FILES if n in sizes] + weights
    todo = [n for n in todo if not cached(n)]
    shown = None
    if todo and not constants.HF_HUB_DISABLE_PROGRESS_BARS:
        total = sum(sizes.get(n) or 0 for n in todo)
        shown = DownloadProgress(repo, total, len(todo), stream)
    try:
        for name in todo:
            get(name, shown)
    finally:
        if shown is not None:
            shown.close()
    snapshot = get("config.json").parent  # cached by now: no request
    _write_ref(snapshot, wanted_rev, snapshot.name)
    return snapshot

"""What a run shows while it trains: a console progress bar with ETA, tensorboard scalars and JSONL metrics.

Only global rank 0 writes. Tensorboard event files go to ``<run_dir>/tensorboard``; one JSON object per logged
step goes to ``<run_dir>/metrics.jsonl`` (appended, so a resumed run continues the same file). A run that starts
at step N (resumed from its checkpoint of step N) first moves the records of later steps -- steps it rolled
back and is about to train again -- to ``metrics.rolled_back.jsonl``, so no step appears twice (in whole-file
steps a kill cannot tear: ``roll_back_jsonl``); tensorboard purges them itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Iterator, Optional

import torch.distributed as dist
import yaml

from megadare.config import to_yaml
from megadare.console import progress_bar
from megadare.errors import RunStateError
from megadare.files import temp_of, write_text_atomic


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Monitor:
    """The monitor of a run's ``logging`` section (run_dir, tensorboard, jsonl, log_interval) over ``total_steps``
    from ``start_step``; ``desc`` names the progress bar."""

    def __init__(self, logging, total_steps: int, *, start_step: int = 0, desc: str = "train", enabled=None):
        run_dir, jsonl, tensorboard = logging.run_dir, logging.jsonl, logging.tensorboard
        self.enabled = _is_rank0() if enabled is None else enabled
        self.log_interval = max(1, logging.log_interval)
        self.writer = None
        self._tb_errors: list[OSError] = []  # what tensorboard's writer thread failed to write
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl") if jsonl else None
        self.bar = None
        self._t0 = time.perf_counter()
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if self.jsonl_path:
            roll_back_jsonl(self.jsonl_path, start_step)
        if tensorboard:
            self.writer = _open_tensorboard(os.path.join(run_dir, "tensorboard"), start_step)
            self._tb_errors = _keep_write_errors(self.writer)

        self.bar = progress_bar(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)

    def step_timer(self) -> float:
        """Seconds since the previous call (or construction)."""
        now = time.perf_counter()
        dt, self._t0 = now - self._t0, now
        return dt

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """Metrics of ``step``; names with a '/' keep their own tensorboard group (e.g. 'eval/accuracy'), the rest
        go under 'train/'. ``advance=False`` logs without moving the progress bar (evaluations)."""
        if not self.enabled:
            return
        if self.bar is not None:
            shown = {
                k: f"{metrics[k]:.4g}"
                for k in ("loss", "reward", "grad_norm", "lr", "tokens_per_s", "eval/accuracy")
                if k in metrics
            }
            self.bar.set_postfix(shown, refresh=False)  # before the step: the frame it draws shows this step's
            if advance:
                self.bar.update(1)
        if advance and step % self.log_interval:
            return
        writing = None
        try:
            if self.writer is not None:
                writing = self.writer.get_logdir()
                for k, v in metrics.items():
                    self.writer.add_scalar(k if "/" in k else f"train/{k}", v, step)
                self.writer.flush()
                if self._tb_errors:  # the thread's failed write of this step, known once flush() returns
                    raise self._tb_errors[0]
            if self.jsonl_path:
                writing = self.jsonl_path
                with open(self.jsonl_path, "a") as f:
                    f.write(json.dumps({"step": step, **metrics}) + "\n")
        except OSError as e:  # a full disk, a file-size limit: one line, not a traceback from the middle of a step
            where = e.filename or writing
            self.close()  # the bar ends its line: the error stands on its own
            raise RunStateError(
                f"writing the metrics of step {step} to {where} failed: {e.strerror or e}; the steps since the "
                "newest checkpoint are lost: free space, then rerun the same command to resume from it"
            ) from None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:  # its writer thread's failure again (each log flushes): that log said it in one line
                pass


def _open_tensorboard(log_dir: str, start_step: int):
    """A SummaryWriter on ``log_dir`` purging the steps after ``start_step``; a directory that cannot be written
    (a full disk: the first event is written at once) is one line naming it, not tensorboard's thread traceback."""
    from torch.utils.tensorboard import SummaryWriter  # heavy: tensorboard, only when logging asks for it

    _quiet_tensorboard_thread()
    try:
        return SummaryWriter(log_dir=log_dir, purge_step=start_step + 1)
    except OSError as e:
        raise RunStateError(
            f"writing the tensorboard events to {e.filename or log_dir} failed: {e.strerror or e}; free space (or "
            "set logging.tensorboard=false), then rerun the same command"
        ) from None


def _keep_write_errors(writer) -> list[OSError]:
    """The list that collects the write errors of ``writer``'s event-file thread from now on (it lives on). Its
    own record of an error is set only after ``flush()`` returns: a failed write went unsaid until the next step's,
    and the last step's for good."""
    errors: list[OSError] = []
    try:
        record_writer = writer.file_writer.event_writer._async_writer._writer
    except AttributeError:  # another tensorboard: its thread's error is raised at a later write
        return errors
    for name in ("write", "flush"):

        def kept(*args, _real=getattr(record_writer, name)):
            try:
                return _real(*args)
            except OSError as e:
                errors.append(e)

        setattr(record_writer, name, kept)
    return errors


def _quiet_tensorboard_thread() -> None:
    """tensorboard's writer thread dies of a write error (a full disk) with a traceback of its own on stderr, then
    the trainer's next write raises that error again (``Monitor.log`` says it in one line): the thread's copy
    is left unprinted. Other threads' errors print as before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard: its traceback prints
        return
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args):
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


ROLLED_BACK = "metrics.rolled_back.jsonl"


def jsonl_records(path: str) -> Iterator[tuple[str, Optional[dict]]]:
    """Each non-blank line of a run's metrics file with its record (None: a torn last line of a killed run, not a
    record of any step)."""
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            yield line, (record if isinstance(record, dict) else None)


def roll_back_jsonl(path: str, step: int) -> int:
    """Keep the records of steps <= ``step`` in ``path``; append the others to ``metrics.rolled_back.jsonl`` beside it
    (nothing is lost, nothing doubled, whenever a kill strikes: ``_commit_roll_back``). Returns how many moved."""
    rolled = os.path.join(os.path.dirname(path), ROLLED_BACK)
    _finish_roll_back(path, rolled)  # what a killed run's roll-back left
    if not os.path.exists(path):
        return 0
    keep, later = [], []
    for line, record in jsonl_records(path):
        s = None if record is None else record.get("step")
        (keep if isinstance(s, int) and s <= step else later).append(line if line.endswith("\n") else line + "\n")
    if later:
        _commit_roll_back(path, rolled, keep, later)
    return len(later)


def _commit_roll_back(path: str, rolled: str, keep: list[str], later: list[str]) -> None:
    """Both files in whole-file steps: (1) the rolled-back file with ``later`` appended, complete, as
    ``<rolled>.new``; (2) the kept records, complete, as ``<path>.new`` -- the commit; (3) ``<rolled>.new``
    replaces ``rolled``; (4) ``<path>.new`` replaces ``path``. Appending in place, then replacing ``path``, doubled
    the moved records in the rolled-back file when a kill fell between the two (the rerun moved them again)."""
    before = []
    if os.path.exists(rolled):
        with open(rolled, errors="replace") as f:
            before = [x if x.endswith("\n") else x + "\n" for x in f if x.strip()]
    write_text_atomic(rolled + ".new", "".join(before + later))
    write_text_atomic(path + ".new", "".join(keep))
    os.replace(rolled + ".new", rolled)
    os.replace(path + ".new", path)


def _finish_roll_back(path: str, rolled: str) -> None:
    """Complete a roll-back that a kill interrupted after its commit (``<path>.new`` in place: steps 3 and 4 of
    ``_commit_roll_back``), or undo one interrupted before it (drop ``<rolled>.new``); temp files go."""
    for tmp in (temp_of(path + ".new"), temp_of(rolled + ".new")):  # write_text_atomic's of the two
        if os.path.exists(tmp):
            os.remove(tmp)
    if os.path.exists(path + ".new"):
        if os.path.exists(rolled + ".new"):
            os.replace(rolled + ".new", rolled)
        os.replace(path + ".new", path)
    elif os.path.exists(rolled + ".new"):
        os.remove(rolled + ".new")


RUN_CONFIG_HEADER = "# the resolved config of this megadare run (rewritten at each start)\n"
# the sections of every resolved config a run wrote before the header existed
_RUN_CONFIG_SECTIONS = {"model", "parallel", "train", "data", "checkpoint", "logging", "seed"}


def foreign_run_config(run_dir: str) -> Optional[str]:
    """A one-line refusal when ``<run_dir>/config.yaml`` exists and no megadare run wrote it (the user's own
    config, kept in the run directory): the run would replace it with its resolved config. None otherwise."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.lexists(path):
        return None
    try:
        with open(path, errors="replace") as f:
            text = f.read()
        ours = text.startswith(RUN_CONFIG_HEADER) or _RUN_CONFIG_SECTIONS <= set(yaml.safe_load(text) or {})
    except (OSError, yaml.YAMLError, TypeError):
        ours = False
    if ours:
        return None
    return (
        f"{path} was not written by a megadare run; a run writes its resolved config there and would replace it: "
        "move it out of logging.run_dir (--config can read it from anywhere), or choose another logging.run_dir"
    )


def write_run_config(cfg) -> None:
    """``<run_dir>/config.yaml``: the resolved config of this run (rank 0; ``foreign_run_config`` checked first),
    replaced in one rename."""
    path = os.path.join(cfg.logging.run_dir, "config.yaml")
    try:  # whole or not at all: an empty or torn config.yaml (a kill or a full disk mid-write) no longer reads as
        # the user's own, refusing every later start of the run
        write_text_atomic(path, RUN_CONFIG_HEADER + to_yaml(cfg))
    except OSError as e:
        raise RunStateError(
            f"writing the run's resolved config to {path} failed: {e.strerror or e}; nothing was trained and the "
            "checkpoints are as they were: free space (or make the directory writable), then rerun the same command"
        ) from None

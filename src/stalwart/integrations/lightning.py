"""stalwart for Lightning 2.x: a callback, and a mixin for the rerun state machine.

``pip install 'stalwart[lightning]'``. Usage::

    import lightning.pytorch as L
    from stalwart.integrations.lightning import GuardedModule, StalwartCallback, latest_checkpoint
    from stalwart.reliability.rerun import RerunConfig

    class MyModule(GuardedModule, L.LightningModule):     # GuardedModule first
        def forward_step(self, batch):                    # the loss (or {"loss": ..., ...})
            return self.model(**batch).loss
        def configure_optimizers(self):                   # fused: the step is gated on the device
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    callback = StalwartCallback(save_dir, rerun=RerunConfig())   # + exit=, ft=, log=, the probes
    trainer = L.Trainer(max_steps=1000, callbacks=[callback], enable_checkpointing=False)
    trainer.fit(MyModule(), loader, ckpt_path=latest_checkpoint(save_dir), weights_only=True)

What the callback does, hook by hook:

* ``setup``: builds the :class:`~stalwart.loop.Shell` (its hang monitor
  opens the ``setup`` section: model set-up and the checkpoint load are guarded);
* ``on_train_start``: builds the guarded step of a :class:`GuardedModule`;
* the first ``on_train_batch_start``: installs the exit-signal handler *over Lightning's*
  (Lightning's SIGTERM handler runs a broadcast inside the signal handler and raises at the next
  batch without a save; stalwart's only raises a flag that the ranks agree on after the step),
  restores the callback's state (every RNG: after Lightning created the loader's iterator,
  which draws from torch's generator), starts the timers;
* around every batch: the watchdog's ``step`` section and a goodput step; with
  ``LogConfig(log_throughput=True)`` the first batch's FLOPs are counted once by torch's counter
  (TFLOP/s in the log line);
* ``on_train_batch_end``: the training-log line (timers, memory, energy, stragglers, goodput,
  TensorBoard/W&B/JSONL; at a log step the interval's loss to the progress bar as ``loss`` and
  stalwart's values to ``trainer.loggers`` as ``stalwart/<name>``, with the learning rate the
  step used), then one agreed decision: save through ``trainer.save_checkpoint``
  (``<save_dir>/iter_NNNNNNN.ckpt``, the signal, ``ExitConfig.save_interval``, duration, exit
  interval, the last step), then stop. After a rejected iteration the save holds Lightning's
  loop and the loader's position as at its start (a relaunch is handed its batch again). Exits
  16 and 17 raise ``SystemExit(code)`` after the save and the exit record, so the code reaches
  the launcher; graceful exits stop the trainer and finish at its end (exit 0);
* ``on_validation_*``: Lightning's validation inside the shell's evaluation (goodput, the
  watchdog's evaluation sections), its mean loss (what ``validation_step`` returns, else the
  ``val*`` metrics logged) in the validation lines and sinks.

The rerun state machine needs to own forward-backward and the optimizer step: a
:class:`GuardedModule` runs in manual optimization; its ``training_step`` hands the batch (one
micro-batch, one iteration) to a :class:`stalwart.loop.GuardedStep` that runs ``forward_step``,
``manual_backward``, the device checks, a replay on the same batch and RNG when a check fails,
the clip (``stalwart_clip_grad``) and the optimizer step, gated on the device for fused
Adam/AdamW/SGD (a rejected iteration never touches the weights). Step-interval LR schedulers are
stepped after each accepted or skipped iteration (``ReduceLROnPlateau`` is not: it needs a
metric); a skipped one (``RerunConfig.iterations_to_skip``, the tracker file) counts as one of
``max_steps``.

Under DDP the step is built on the strategy's wrapper (the checks run in DDP's comm hook on each
rank's own gradients, so a fault is blamed on its rank and replayed on a peer), and a
:class:`~stalwart.integrations.resumable.ResumableLoader` passed to ``fit`` is sharded as Lightning
shards a ``DataLoader`` (:mod:`stalwart.integrations.lightning_checks`). After an exit 17 the
verdict names the ``iter_NNNNNNN.ckpt`` to train on from; a suspect device exits 16.

Every probe of :class:`~stalwart.loop.ShellConfig` works as in the trainer (its fields are the
callback's keywords); tensor dumps need a :class:`GuardedModule` (they are refused without).
Limits: one optimizer, ``accumulate_grad_batches=1`` (an iteration is one batch), no
``gradient_clip_val`` (Lightning forbids it with manual optimization: use ``stalwart_clip_grad``);
a kept ``training_step``, several optimizers and ``GuardedModule`` after ``LightningModule`` in
the bases are refused in one line.
Checkpoints hold every rank's RNG (Lightning saves none) and the rerun state, so a resume is
bitwise (tested on one process and under DDP on 2 gloo ranks); the data position is Lightning's
(a mid-epoch resume is exact when the loader's order is fixed, e.g. ``shuffle=False`` or a
seeded sampler, wrapped in :class:`~stalwart.integrations.resumable.ResumableLoader`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.distributed import collectives
from stalwart.integrations import require
from stalwart.integrations.framework_step import FrameworkStep, refuse_framework_saves
from stalwart.integrations.lightning_checks import (
    as_before_the_batch,
    refuse_unguardable,
    refuse_unsharded,
    shard_resumable_loaders,
)
from stalwart.integrations.lightning_module import GuardedModule, StepSchedulers
from stalwart.integrations.offered_metrics import offered_metrics
from stalwart.iteration_dirs import iteration_dir_name
from stalwart.loop import Names, RngState, StepResult
from stalwart.loop.shell import Shell
from stalwart.loop.shell_config import ShellConfig
from stalwart.observability.flop_count import count_training_flops, flop_counter
from stalwart.reliability.exit import ExitDecision, ExitReason, SaveKind
from stalwart.reliability.rerun.attribution.verdict_file import SuspectDeviceError

L = require("lightning.pytorch", extra="lightning", what="stalwart.integrations.lightning")

logger = logging.getLogger(__name__)

NAMES = Names.LIGHTNING  # its messages name StalwartCallback(exit=ExitConfig(...)), max_steps
LATEST_FILE = "latest_lightning_checkpoint.txt"
STATE_VERSION = 1


def checkpoint_path(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, iteration_dir_name(iteration) + ".ckpt")


def latest_checkpoint(save_dir: str | None) -> str | None:
    """The newest checkpoint the callback saved (for ``trainer.fit(ckpt_path=...)``), or None.

    Read from ``<save_dir>/latest_lightning_checkpoint.txt``, written after the save completed;
    a pointer to a missing file or outside ``save_dir`` is ignored."""
    if not save_dir:
        return None
    try:
        with open(os.path.join(save_dir, LATEST_FILE), encoding="utf-8") as f:
            name = f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = os.path.join(save_dir, name)
    if os.path.basename(name) != name or not os.path.isfile(path):
        return None
    return path


def _forward_step(batch: Any, model: Any) -> Any:
    return model.forward_step(batch)


class StalwartCallback(L.Callback):  # type: ignore[misc,name-defined]
    """stalwart's shell for a Lightning run (see the module docstring).

    Args:
        save_dir: where the callback's saves go (``iter_NNNNNNN.ckpt``), ``exit_reason.json``
            and the rerun files; None: no save (an exit 16 then says it needs one).
        count_flops: with ``LogConfig(log_throughput=True)``, count the first batch's FLOPs with
            torch's counter (TFLOP/s); False: no TFLOP/s (the shell then refuses the setting).
        **shell: :class:`ShellConfig`'s other fields (the exits, ``ft``, ``rerun``, ``log``, the
            probes, ...); ``train_iters`` is the trainer's ``max_steps``.
    """

    def __init__(self, save_dir: str | None = None, *, count_flops: bool = True, **shell: Any):
        super().__init__()
        self.save_dir = save_dir
        self.count_flops = count_flops
        self._shell_fields = shell
        # Bad fields and settings this path cannot honour fail here, early, in one line.
        refuse_framework_saves(ShellConfig(train_iters=1, save_dir=save_dir, **shell), NAMES)
        self.shell: Shell | None = None
        self.step: FrameworkStep | None = None
        self._loaded: dict[str, Any] | None = None
        self._in_step: contextlib.AbstractContextManager[Any] | None = None  # shell.iteration()
        self._evaluating: contextlib.ExitStack | None = None  # the shell's evaluation()
        self._eval_step: contextlib.ExitStack | None = None  # its eval_iteration()
        self._eval_losses: list[torch.Tensor] = []
        self._counter: Any = None  # torch's FLOP counter, around the first iteration
        self._counted = not count_flops
        self._stepped = -1  # Lightning's global_step at the last iteration's end
        self._lr: float | None = None  # the step's learning rate (read before a schedule steps)
        # Read once per fit, not per batch (Lightning's properties walk the strategy).
        self._optimizers: list[Any] = []
        self._world_size = 1
        self._pending_exit: ExitDecision | None = None  # a graceful exit: at the loop's end
        self._begun = False

    @property
    def exit_code(self) -> int | None:
        """The run's exit code once it decided to exit (None before)."""
        return self.shell.exit_code if self.shell is not None else None

    # ---------------------------------------------------------------- set-up
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.shell is not None:
            return
        shard_resumable_loaders(trainer)  # before Lightning takes the loader's length
        iters = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        config = ShellConfig(train_iters=int(iters), save_dir=self.save_dir, **self._shell_fields)
        self.shell = config.build(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            device=trainer.strategy.root_device,
            names=NAMES,
        )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        shell = self._require_shell()
        refuse_unsharded(trainer)
        if isinstance(pl_module, GuardedModule):
            optimizer = pl_module.optimizers()  # type: ignore[attr-defined]
            refuse_unguardable(pl_module, optimizer)
            # The strategy's model (DDP's wrapper): the step's checks then run in DDP's comm
            # hook, on this rank's own gradients before the all-reduce (blame stays local).
            self.step = FrameworkStep(
                shell,
                model=trainer.strategy.model,
                optimizer=optimizer,
                forward_step=lambda batch, model: pl_module.forward_step(batch),
                clip_grad=pl_module.stalwart_clip_grad,
                backward=pl_module.manual_backward,  # type: ignore[attr-defined]
            )
            pl_module.stalwart_step = self.step
            pl_module._stalwart_schedulers = StepSchedulers(trainer)  # this fit's
        else:
            shell.refuse_without_step()  # Lightning's own step: what needs ours, refused now
            shell.watch(pl_module)  # log_params_norm and the replica check read it
        self._begun = False

    def _begin(self, trainer: Any) -> None:
        """At the first batch, not in ``on_train_start``: Lightning creates the data loader's
        iterator in between, which draws from torch's generator (its base seed); restoring the
        RNG before that would make the resumed run draw differently from the uninterrupted one."""
        shell = self._require_shell()
        self._restore(trainer)
        self._optimizers, self._world_size = list(trainer.optimizers), int(trainer.world_size)
        self._stepped = int(trainer.global_step)
        shell.resumed(shell.completed if self.step is not None else self._stepped)
        shell.start()
        self._begun = True

    def _restore(self, trainer: Any) -> None:
        """Apply the loaded state: this rank's RNG (and the step's count and rerun state)."""
        state, self._loaded = self._loaded, None
        if state is None:
            return
        ranks = state.get("ranks", [])
        if len(ranks) != trainer.world_size:
            logger.warning(
                "world size changed (%d -> %d): RNG and rerun state not restored",
                len(ranks),
                trainer.world_size,
            )
            return
        mine = ranks[trainer.global_rank]
        if self.step is not None and "step" in mine:
            try:
                self.step.load_state_dict(mine["step"], checkpoint_path=_str(trainer.ckpt_path))
            except SuspectDeviceError as exc:  # exit 16 with the verdict's line: run elsewhere
                self._require_shell().print(f"stalwart: {exc}", flush=True)
                raise SystemExit(exc.exit_code) from None
        else:
            RngState().load_state_dict(mine["rng"])

    def _require_shell(self) -> Shell:
        if self.shell is None:
            raise RuntimeError("StalwartCallback: the trainer did not call setup('fit')")
        return self.shell

    # ---------------------------------------------------------------- per batch
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        shell = self._require_shell()
        if not self._begun:
            self._begin(trainer)
        if self._in_step is not None:  # accumulating gradients: the step spans several batches
            return
        if not self._counted and shell.config.log.log_throughput:
            self._count_flops(trainer, pl_module, batch)
        optimizers = self._optimizers  # the step's rate: schedules step inside the batch
        self._lr = optimizers[0].param_groups[0]["lr"] if optimizers else None
        iteration = shell.iteration()
        iteration.__enter__()
        self._in_step = iteration

    def _count_flops(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """A guarded module: one forward + backward of this batch under torch's counter, with
        no trace (``count_training_flops``). Any other module: its first iteration runs under
        the counter (the optimizer step under a dispatch mode may round differently)."""
        if self.step is None:
            self._counter = flop_counter()
            self._counter.__enter__()
            return
        counted = count_training_flops(pl_module, _forward_step, batch)
        self._require_shell().set_flops(
            counted.per_iteration(data_parallel_size=trainer.world_size)
        )
        self._counted = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        shell = self._require_shell()
        result = self.step.result if self.step is not None else None
        stepped = int(trainer.global_step)
        if result is None and stepped == self._stepped:
            return  # Lightning's own step, still accumulating gradients
        self._end_step(trainer)
        self._stepped = stepped
        rejected = result is not None and result.verdict.exit
        if not rejected:
            self._record(trainer, pl_module, outputs, batch, result)
        decision = shell.decide(result, can_save=bool(self.save_dir))
        if decision.save is not SaveKind.NONE:
            non_persistent = decision.save is SaveKind.NON_PERSISTENT
            self._save(trainer, non_persistent=non_persistent, rejected=rejected)
        if decision.exit:
            self._leave(trainer, decision)

    def _end_step(self, trainer: Any) -> None:
        iteration, self._in_step = self._in_step, None
        if iteration is not None:
            iteration.__exit__(None, None, None)
        counter, self._counter = self._counter, None
        if counter is not None and self.shell is not None:
            counter.__exit__(None, None, None)
            self._counted = True
            # One iteration of this rank; every data-parallel rank does the same.
            self.shell.set_flops(float(counter.get_total_flops()) * trainer.world_size)

    def _record(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, result: StepResult | None
    ) -> None:
        losses: dict[str, Any] | None = None  # a guarded step's result reports its own
        if result is None:  # Lightning's own step: the loss its training_step returned
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            losses = {"lm loss": loss.detach() if isinstance(loss, torch.Tensor) else loss}
        record = self._require_shell().record(
            result,
            batch_size=max(_batch_size(batch), 1) * self._world_size,
            losses=losses,
            learning_rate=self._lr,
        )
        if record is not None:  # a log step, rank 0: host values, no device read
            _offer(trainer, pl_module, record)

    def _save(self, trainer: Any, *, non_persistent: bool, rejected: bool) -> None:
        """Through ``trainer.save_checkpoint`` (non-persistent saves are refused at start).
        After a rejected iteration the loop's state and the loader's position are saved as at
        its start: a relaunch is handed the same batch again."""
        shell = self._require_shell()
        assert self.save_dir is not None
        path = checkpoint_path(self.save_dir, shell.completed)
        before = as_before_the_batch(trainer) if rejected else contextlib.nullcontext()
        with shell.saving(non_persistent=non_persistent), before:
            trainer.save_checkpoint(path, weights_only=False)  # with the optimizer and loops
            shell.checkpoint_at(shell.completed, os.path.basename(path))
            if trainer.is_global_zero:
                _write_latest(self.save_dir, os.path.basename(path))
            collectives.barrier()  # no rank resumes from a pointer another has not written

    def _leave(self, trainer: Any, decision: ExitDecision) -> None:
        """16/17: finish and raise now (through Lightning's teardown to the launcher). A
        graceful exit stops Lightning's loop and finishes at its end (an evaluation Lightning
        runs after this batch is still the run's)."""
        if decision.exit_code:
            code = self._require_shell().finish(decision)
            self._close()
            raise SystemExit(code)
        self._pending_exit = decision
        trainer.should_stop = True

    # ---------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.shell is None or not self._begun or self._evaluating is not None:
            return  # the sanity check before training: not the run's evaluation
        self._evaluating = contextlib.ExitStack()
        self._evaluating.enter_context(self.shell.evaluation())
        self._eval_losses = []

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._evaluating is not None and self.shell is not None:
            self._eval_step = contextlib.ExitStack()
            self._eval_step.enter_context(self.shell.eval_iteration())

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        step, self._eval_step = self._eval_step, None
        if step is None:
            return
        step.close()
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self._eval_losses.append(loss.detach().float())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        stack, self._evaluating = self._evaluating, None
        if stack is None or self.shell is None:
            return
        stack.close()
        losses = self._validation_losses(trainer)
        if losses:
            self.shell.record_eval(losses)

    def _validation_losses(self, trainer: Any) -> dict[str, Any]:
        """The validation steps' returned losses (their mean, as ``lm loss``), else what the
        module logged under ``val*`` names."""
        if self._eval_losses:
            return {"lm loss": torch.stack(self._eval_losses).mean()}
        metrics = trainer.callback_metrics
        return {k: v for k, v in metrics.items() if k.startswith("val")}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Every rank's state, gathered (Lightning writes rank 0's dict only): RNG, and for a
        :class:`GuardedModule` the guarded step's. Collective: Lightning calls it on every rank."""
        mine = {"step": self.step.state_dict()} if self.step is not None else {}
        mine["rng"] = RngState().state_dict()
        return {"version": STATE_VERSION, "ranks": collectives.all_gather_objects(mine)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)  # applied at the first batch, once the step exists

    # ---------------------------------------------------------------- the end
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        shell = self.shell
        if shell is not None and shell.exit_code is None:
            self._end_step(trainer)
            ended = ExitDecision(  # Lightning's loop ended before a decision did
                SaveKind.NONE, True, ExitReason.FINISHED, "the trainer's loop ended"
            )
            shell.finish(self._pending_exit or ended)
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The step's contexts end with the error (the iteration is not done), the ledger
        records the fault, everything is released before Lightning re-raises it."""
        stack, self._in_step = self._in_step, None
        if stack is not None:
            stack.__exit__(type(exception), exception, exception.__traceback__)
        shell = self.shell
        if shell is not None and shell.exit_code is None:
            shell.fault(exception)
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        iteration, self._in_step = self._in_step, None
        if iteration is not None:
            iteration.__exit__(None, None, None)
        for stack in (self._eval_step, self._evaluating):
            if stack is not None:
                stack.close()
        self._eval_step = self._evaluating = None
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        if self.step is not None:
            self.step.close()
        if self.shell is not None:
            self.shell.close()


def _offer(trainer: Any, pl_module: Any, record: Mapping[str, Any]) -> None:
    """A log step's values to Lightning: the interval's loss to its progress bar (``loss``, a
    CPU tensor: the bar's refreshes read it without a device sync), stalwart's values
    (`stalwart.integrations.offered_metrics`) to ``trainer.loggers`` at Lightning's step."""
    loss = record.get("loss")
    if loss is not None and trainer.progress_bar_callback is not None:
        value = torch.tensor(float(loss))
        pl_module.log("loss", value, prog_bar=True, logger=False, on_step=True, batch_size=1)
    metrics = offered_metrics(record)
    for logger_ in trainer.loggers:
        logger_.log_metrics(metrics, step=trainer.global_step)


def _batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 when it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch
    for value in items if isinstance(items, list | tuple) or isinstance(batch, Mapping) else ():
        size = _batch_size(value)
        if size:
            return size
    return 0


def _write_latest(save_dir: str, name: str) -> None:
    path = os.path.join(save_dir, LATEST_FILE)
    write_text_atomic(path, name + "\n", sync=Sync.FILE)


def _str(path: Any) -> str | None:
    return None if path is None else os.fspath(path)


__all__ = ["GuardedModule", "StalwartCallback", "checkpoint_path", "latest_checkpoint"]

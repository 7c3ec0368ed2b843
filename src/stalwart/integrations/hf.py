"""stalwart for the Hugging Face ``Trainer``: a ``TrainerCallback``, and a ``Trainer`` subclass
for the rerun state machine.

``pip install 'stalwart[hf]'``. Usage::

    from stalwart.integrations.hf import StalwartCallback, StalwartTrainer
    from stalwart.reliability.rerun import RerunConfig

    callback = StalwartCallback(rerun=RerunConfig())          # + exit=, ft=, log=, the probes
    trainer = StalwartTrainer(model=model, args=TrainingArguments(output_dir, max_steps=1000),
                              train_dataset=dataset, callbacks=[callback])
    trainer.train(resume_from_checkpoint=latest_checkpoint(output_dir))
    raise SystemExit(callback.exit_code or 0)                  # 16/17 raise SystemExit earlier

What the callback does, hook by hook (it maps stalwart's decisions onto ``TrainerControl``):

* ``on_train_begin``: builds the :class:`~stalwart.loop.Shell` (hang
  monitor, the goodput ledger, the sinks) and installs the exit-signal handler (SIGTERM only
  raises a flag; the ranks agree on it after the step);
* ``on_step_begin`` / ``on_step_end``: the watchdog's ``step`` section and a goodput step around
  the Trainer's step (the learning rate read before the step: the one it used); then the
  training-log line (timers, memory, energy, stragglers, goodput, TensorBoard/W&B/
  ``metrics.jsonl``; a log step's values offered to the Trainer's next logs) and one agreed
  decision: a save sets
  ``control.should_save`` (the Trainer's own ``checkpoint-N``, inside the ``checkpointing``
  section and the save timer), an exit sets ``control.should_training_stop``; after a rejected
  iteration (16/17) the Trainer's ``global_step``, epoch and LR schedule are put back to the
  iteration's start (it is not a step), so ``checkpoint-N`` holds N completed iterations and a
  relaunch is handed the rejected batch again;
* ``on_save``: stalwart's part of the checkpoint (``stalwart_state_rank<r>.pt``: the completed
  count, the guarded step, the rerun machine, every RNG), then the exit: 16 and 17 raise
  ``SystemExit(code)`` so the code reaches the launcher; a graceful one finishes at the
  Trainer's end (its evaluation after the last step is still the run's);
* ``on_evaluate`` (and ``StalwartTrainer.evaluate``): the evaluation in the shell's (goodput,
  the watchdog) and its ``eval_loss`` in the validation lines and sinks.

:class:`StalwartTrainer` is needed for the rerun state machine (and for TFLOP/s: it counts the
first step's FLOPs with torch's counter): it overrides ``training_step`` so that a
:class:`stalwart.integrations.framework_step.FrameworkStep` runs the forward (``compute_loss``),
the backward (``accelerator.backward``), the device checks, a replay on the same batch and RNG,
the clip (``max_grad_norm``) and the optimizer step (gated on the device for fused AdamW: a
rejected iteration never touches the weights). Its LR schedule is built on the optimizer the
guarded step steps (torch counts that step: no "``lr_scheduler.step()`` before
``optimizer.step()``" warning), and its ``log`` adds stalwart's values of the last log step
(``stalwart/loss``, ``stalwart/grad_norm``, throughput, the skipped and NaN iterations, ...) to
the logs its callbacks (TensorBoard, W&B) receive. The loss is the plain Trainer's
(``compute_loss`` with ``num_items_in_batch``); the Trainer's own ``optimizer.step()`` that
follows is a no-op during ``train()`` and the ``grad_norm`` it logs is the guarded step's (the
norm before the clip, as the Trainer's).

Limits: ``gradient_accumulation_steps=1`` (an iteration is one batch; refused before training);
tensor dumps need :class:`StalwartTrainer` and start at the second step (the guarded step is
built inside the first); no non-persistent saves (the Trainer's checkpoints are persistent:
refused in one line). DeepSpeed and SageMaker's model parallelism are not supported by the
subclass. The callback alone (on a plain ``Trainer``) gives the sections, the exit, the goodput
ledger and the log line without the loss (the Trainer does not hand it to callbacks; its own
``logs`` carry it); what needs the guarded step (the rerun machine, the skip list, dumps) is
refused at start there. A resume is exact when the Trainer's data order is (it restores its RNG
and skips the consumed batches; tested bitwise on one process, and after 17 and 16 on 2 ranks).
An error the user's model raises inside the Trainer is the last thing printed: the shell is
released (silently) before it reaches the user.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from typing import Any

import torch

from stalwart.integrations import require
from stalwart.integrations.framework_step import FrameworkStep, refuse_framework_saves
from stalwart.integrations.offered_metrics import offered_metrics
from stalwart.loop import Names, StepResult
from stalwart.loop.shell import Shell
from stalwart.loop.shell_config import ShellConfig
from stalwart.observability.flop_count import count_training_flops
from stalwart.reliability.exit import ExitDecision, ExitReason, SaveKind
from stalwart.reliability.rerun.attribution.verdict_file import SuspectDeviceError

transformers = require("transformers", extra="hf", what="stalwart.integrations.hf")

logger = logging.getLogger(__name__)

NAMES = Names.HF  # its messages name StalwartCallback(exit=ExitConfig(...)), max_steps
STATE_FILE = "stalwart_state_rank{rank}.pt"
CHECKPOINT_PREFIX = "checkpoint-"


def latest_checkpoint(output_dir: str | None) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir`` (for
    ``trainer.train(resume_from_checkpoint=...)``), or None."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    found = transformers.trainer_utils.get_last_checkpoint(output_dir)
    return str(found) if found else None


class StalwartCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
    """stalwart's shell for a Hugging Face ``Trainer`` run (see the module docstring).

    Args:
        save_dir: where ``exit_reason.json``, ``ft_state.json`` and the rerun files go
            (default: the Trainer's ``output_dir``).
        **shell: :class:`ShellConfig`'s other fields (the exits, ``ft``, ``rerun``, ``log``, the
            probes, ...); ``train_iters`` is the Trainer's.
    """

    def __init__(self, save_dir: str | None = None, **shell: Any) -> None:
        # Bad fields and settings this path cannot honour fail here, early, in one line (the
        # save directory defaults to the output_dir).
        refuse_framework_saves(ShellConfig(train_iters=1, save_dir=save_dir or ".", **shell), NAMES)
        self.save_dir = save_dir
        self._shell_fields = shell
        self.shell: Shell | None = None
        self.guarded = False  # StalwartTrainer runs the step (set before train starts)
        self.step: FrameworkStep | None = None  # set by StalwartTrainer
        self.result: StepResult | None = None  # the last guarded step's
        self.loss: torch.Tensor | None = None  # the last step's loss (StalwartTrainer)
        self._in_step: contextlib.AbstractContextManager[Any] | None = None  # shell.iteration()
        self._saving: contextlib.ExitStack | None = None
        self._pending_exit: ExitDecision | None = None
        self._exit_code: int | None = None  # kept after close
        self._global_batch = 0
        self._epoch = 0.0  # the Trainer's epoch before the step (a rejected one: put back)
        self._lr: float | None = None  # the step's learning rate (read before its schedule steps)
        self.offered: dict[str, float] = {}  # the last log step's values, for the Trainer's logs

    @property
    def exit_code(self) -> int | None:
        """The run's exit code once it decided to exit (None before)."""
        return self.shell.exit_code if self.shell is not None else self._exit_code

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.shell is None:
            save_dir = self.save_dir or args.output_dir
            config = ShellConfig(
                train_iters=int(state.max_steps), save_dir=save_dir, **self._shell_fields
            )
            self.shell = config.build(
                rank=args.process_index,
                world_size=args.world_size,
                device=args.device,
                names=NAMES,
            )
            # An error the Trainer does not report to callbacks (a plain Trainer's): released
            # at exit, silently, before the interpreter tears its modules down.
            atexit.register(self._abandon)
        if not self.guarded:
            self.shell.refuse_without_step()  # the Trainer's own step: what needs ours
        if kwargs.get("model") is not None:  # StalwartTrainer's step sets it again
            self.shell.watch(kwargs["model"])  # log_params_norm and the replica check
        # args.world_size is a property that asks accelerate's state: once, not every step.
        self._global_batch = args.per_device_train_batch_size * args.world_size
        self.shell.resumed(int(state.global_step))
        self.shell.start()

    def require_shell(self) -> Shell:
        if self.shell is None:
            raise RuntimeError("StalwartCallback: the Trainer did not call on_train_begin")
        return self.shell

    # ---------------------------------------------------------------- per step
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shell = self.require_shell()
        self._epoch = state.epoch
        optimizer = kwargs.get("optimizer")  # the step's rate: its schedule steps after it
        self._lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
        iteration = shell.iteration()
        iteration.__enter__()
        self._in_step = iteration

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shell = self.require_shell()
        iteration, self._in_step = self._in_step, None
        if iteration is not None:
            iteration.__exit__(None, None, None)
        result, self.result = self.result, None
        if result is not None and result.verdict.exit:
            # The Trainer counted the rejected iteration as a step: its state (and the
            # checkpoint saved now) is put back to the iteration's start, so a relaunch skips
            # the completed batches only and is handed the rejected one again.
            state.global_step, state.epoch = shell.completed, self._epoch
        else:
            self._record(result)
        decision = shell.decide(result)
        if decision.save is not SaveKind.NONE:
            control.should_save = True  # the Trainer saves right after this hook, then on_save
            self._saving = contextlib.ExitStack()
            non_persistent = decision.save is SaveKind.NON_PERSISTENT
            self._saving.enter_context(shell.saving(non_persistent=non_persistent))
        if decision.exit:
            control.should_training_stop = True
            self._pending_exit = decision  # 16/17 leave after the save; 0 at the loop's end
            if self._saving is None:
                self._leave_on_code()

    def _record(self, result: StepResult | None) -> None:
        losses = {"lm loss": self.loss} if self.loss is not None else {}  # a plain Trainer's
        record = self.require_shell().record(
            result, batch_size=self._global_batch, losses=losses, learning_rate=self._lr
        )
        if record is not None:  # a log step (rank 0): offered to the Trainer's next logs
            self.offered = offered_metrics(record)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shell = self.require_shell()
        folder = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{state.global_step}")
        if self.step is not None:
            step_state = self.step.state_dict()  # collective: every rank, unconditionally
            os.makedirs(folder, exist_ok=True)  # rank 0 may not have created it yet
            torch.save(step_state, os.path.join(folder, STATE_FILE.format(rank=shell.rank)))
        shell.checkpoint_at(shell.completed, os.path.basename(folder))
        if self._saving is not None:
            self._saving.close()
            self._saving = None
        self._leave_on_code()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer's evaluation metrics (its ``eval_loss`` as Megatron's ``lm loss``):
        the validation lines and sinks (``StalwartTrainer`` also wraps the evaluation in the
        shell's, for goodput and the watchdog)."""
        metrics = kwargs.get("metrics") or {}
        if self.shell is not None and "eval_loss" in metrics:
            self.shell.record_eval({"lm loss": float(metrics["eval_loss"])})

    def _leave_on_code(self) -> None:
        """An exit 16/17 decided: finish and raise now (through the Trainer to the launcher).
        A graceful one finishes at the Trainer's end (its evaluation after this step is still
        the run's)."""
        decision = self._pending_exit
        if decision is not None and decision.exit_code:
            code = self.require_shell().finish(decision)
            self._close()
            raise SystemExit(code)

    # ---------------------------------------------------------------- the end
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shell = self.shell
        if shell is not None and shell.exit_code is None:
            ended = ExitDecision(  # the Trainer's loop ended before a decision did
                SaveKind.NONE, True, ExitReason.FINISHED, "the trainer's loop ended"
            )
            shell.finish(self._pending_exit or ended)
        self._close()

    def fault(self, error: BaseException) -> None:
        """The Trainer raised ``error`` (``StalwartTrainer`` tells): the step's contexts end
        with it, the ledger records the fault, everything is released, before the error
        reaches the user (nothing of stalwart's prints after it)."""
        stack, self._in_step = self._in_step, None
        if stack is not None:
            stack.__exit__(type(error), error, error.__traceback__)
        if self.shell is not None and self.shell.exit_code is None:
            self.shell.fault(error)
        self._close()

    def _abandon(self) -> None:
        """At interpreter exit, a shell still open (the Trainer raised without telling):
        released without a word, the ledger's fault recorded."""
        if self.shell is not None:
            self.shell.print = lambda *a, **k: None
            self.fault(RuntimeError("the Trainer's loop raised"))

    def _close(self) -> None:
        iteration, self._in_step = self._in_step, None
        if iteration is not None:
            iteration.__exit__(None, None, None)
        if self._saving is not None:
            self._saving.close()
        self._saving = None
        if self.step is not None:
            self.step.close()
            self.step = None
        if self.shell is not None:
            atexit.unregister(self._abandon)
            self._exit_code = self.shell.exit_code
            self.shell.close()
            self.shell = None


class _SteppedByTheGuardedStep:
    """The Trainer's optimizer as the Trainer sees it while the guarded step owns the step:
    ``step()`` does nothing (the guarded step stepped the accepted iteration, or kept a
    rejected one from the weights); everything else (state, groups) is the optimizer's."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        del closure

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _HeldSchedule:
    """The Trainer's LR scheduler for the step that follows a rejected iteration: its
    ``step()`` does not advance the schedule and puts the scheduler back (so the exit's
    checkpoint holds the schedule of the iteration's start)."""

    def __init__(self, trainer: Any, scheduler: Any) -> None:
        self.trainer, self.scheduler = trainer, scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.trainer.lr_scheduler = self.scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


class StalwartTrainer(transformers.Trainer):  # type: ignore[misc,name-defined]
    """A ``Trainer`` whose step runs under stalwart's rerun state machine (module docstring).
    Needs a :class:`StalwartCallback` in ``callbacks``."""

    _stalwart_resume: str | None = None
    _stalwart_loss: torch.Tensor | None = None  # this rank's loss of the last forward
    _stalwart_grad_norm: torch.Tensor | None = None  # the last guarded step's

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir)
        self._stalwart_resume = resume_from_checkpoint or None
        callback = self._stalwart_callback()
        if self.args.gradient_accumulation_steps != 1:  # before anything starts: a refusal
            raise ValueError(
                "TrainingArguments(gradient_accumulation_steps=...) must be 1 with "
                "StalwartTrainer (an iteration is one batch), got "
                f"{self.args.gradient_accumulation_steps}"
            )
        callback.guarded = True
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except Exception as exc:  # the user's error: ours is released first, silently after
            callback.fault(exc)
            raise
        finally:
            seen = self.__dict__.get("optimizer")  # set by the Trainer (untyped)
            if isinstance(seen, _SteppedByTheGuardedStep):
                self.optimizer = seen.optimizer  # the Trainer's own again

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's LR schedule, built on the optimizer whose ``step()`` the guarded step
        calls: torch's scheduler counts the steps of the optimizer it was built on, and built on
        Accelerate's wrapper (which the guarded step goes around) it saw none and warned
        "Detected call of `lr_scheduler.step()` before `optimizer.step()`" on every run."""
        stepped = self._stepped_optimizer(optimizer if optimizer is not None else self.optimizer)
        return super().create_scheduler(num_training_steps, optimizer=stepped)

    def _stepped_optimizer(self, optimizer: Any) -> Any:
        """What the guarded step calls ``step()`` on: without a GradScaler Accelerate's wrapper
        adds nothing (every batch syncs) but host work, two package look-ups per step (LOMO),
        so its optimizer; with one, the wrapper (its step is the scaler's)."""
        if self.accelerator.scaler is None:
            return getattr(optimizer, "optimizer", optimizer)
        return optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs (its ``TensorBoardCallback``, ``WandbCallback``, ``log_history``,
        the printed dict) with stalwart's values of its last log step, once each
        (`stalwart.integrations.offered_metrics`: ``stalwart/loss``, ``stalwart/grad_norm``,
        throughput, the skipped and NaN iterations, ...); evaluation logs are left as they are."""
        callback = self._stalwart_callback()
        if callback.offered and not any(key.startswith("eval_") for key in logs):
            logs = {**logs, **callback.offered}
            callback.offered = {}
        super().log(logs, *args, **kwargs)

    def _stalwart_callback(self) -> StalwartCallback:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, StalwartCallback):
                return callback
        raise RuntimeError("StalwartTrainer: add a StalwartCallback to callbacks=")

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        callback = self._stalwart_callback()
        model.train()
        inputs = self._prepare_inputs(inputs)
        batch = (inputs, num_items_in_batch)  # replayed (and saved after an exit 16) together
        if callback.step is None:
            callback.step = self._build_step(callback, model, batch)
            # The guarded step owns the optimizer step: the Trainer's own one, next, is a no-op
            # (its model.zero_grad() after it drops the gradients, as in a plain run).
            self.optimizer = _SteppedByTheGuardedStep(self.optimizer)
        result = callback.step.run([batch])
        callback.result = result
        if result.verdict.exit:  # not a step: the Trainer's schedule does not advance either
            scheduler: Any = getattr(self, "lr_scheduler", None)
            self.lr_scheduler = _HeldSchedule(self, scheduler)
        self._stalwart_grad_norm = result.grad_norm
        loss = self._stalwart_loss  # this rank's, as the plain Trainer returns it (on its device)
        # args.device is a property that asks Accelerate's state: only when there is no loss.
        return loss if loss is not None else torch.zeros((), device=self.args.device)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's evaluation inside the shell's (goodput's evaluation bucket, the
        watchdog's evaluation sections); its metrics reach the shell through the callback."""
        shell = self._stalwart_callback().shell
        if shell is None:  # not during train(): nothing of the run to account it to
            return super().evaluate(*args, **kwargs)
        with shell.evaluation():
            return super().evaluate(*args, **kwargs)

    def _forward_step(self, batch: Any, model: torch.nn.Module) -> torch.Tensor:
        """The plain Trainer's loss: ``compute_loss`` with the batch's ``num_items_in_batch``
        (token-averaged over the data-parallel ranks), averaged over ``n_gpu`` replicas."""
        inputs, num_items_in_batch = batch
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        self._stalwart_loss = loss.detach()
        return loss  # type: ignore[no-any-return]

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """The guarded step clipped (``max_grad_norm``) and stepped already: its norm."""
        del model
        return self._stalwart_grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """The norm the Trainer logs: the guarded step's (the gradients are gone by now)."""
        del model
        return self._stalwart_grad_norm if grad_norm is None else grad_norm

    def _build_step(
        self, callback: StalwartCallback, model: torch.nn.Module, batch: Any
    ) -> FrameworkStep:
        shell = callback.require_shell()
        if shell.config.log.log_throughput:
            counted = count_training_flops(model, self._forward_step, batch)
            shell.set_flops(counted.per_iteration(data_parallel_size=self.args.world_size))
        step = FrameworkStep(
            shell,
            model=model,
            optimizer=self._stepped_optimizer(self.optimizer),
            forward_step=self._forward_step,
            clip_grad=float(self.args.max_grad_norm or 0.0),
            backward=self.accelerator.backward,
        )
        if self._stalwart_resume is not None:
            path = os.path.join(self._stalwart_resume, STATE_FILE.format(rank=shell.rank))
            if os.path.isfile(path):
                state = torch.load(path, map_location="cpu", weights_only=True)
                try:
                    step.load_state_dict(state, checkpoint_path=self._stalwart_resume)
                except SuspectDeviceError as exc:  # exit 16 with the verdict's line
                    shell.print(f"stalwart: {exc}", flush=True)
                    step.close()
                    callback._close()
                    raise SystemExit(exc.exit_code) from None
            else:
                logger.warning("%s: no stalwart state; the guarded step starts fresh", path)
        return step


__all__ = ["StalwartCallback", "StalwartTrainer", "latest_checkpoint"]

"""`python -m trainer.train [--section.key value ...]`: assemble the parts and run the loop.

Started by torchrun (see torchrun_launch.sh), one process per device; started alone it trains as a
world of one.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from trainer.launch import stop_request

if __name__ == "__main__":  # a rank: listen before torch's import, which takes seconds
    stop_request.listen()

import torch
import torch.distributed as dist

from trainer import float8, messages, process_setup
from trainer.launch import run_lock
from trainer.records import run_meta
from trainer.checkpoint.manager import CheckpointError, CheckpointManager, TrainingComplete
from trainer.config.job_config import JobConfig
from trainer.config.manager import ConfigError, help_text, load_config, to_dict, to_toml, with_default_config
from trainer.config.saved_config import write_config_file
from trainer.data.loader import BatchLoader, ProcessGroupPeers, evaluation_batches
from trainer.parallel.collectives import CollectiveCounter, mesh_group_names
from trainer.parallel.collectives import describe as describe_collectives
from trainer.data.build import build_sources, document_eos
from trainer.data.documents import DataError
from trainer.estimate.real import estimate_before_training
from trainer.divergence import NonFiniteLossError, check_gradient_norm, check_parameters
from trainer.data.finite_sources import DataExhausted
from trainer.loss_scale import DynamicLossScaler, LossScaleError, build_loss_scaler, unscale_gradients
from trainer.metrics.step_log import MetricsLogger, StepFigures, should_log, time_stamp
from trainer.hf.model_io import HFWeights
from trainer.records.untrusted_json import RecordError
from trainer.models.llama3.args import flops_per_token
from trainer.models.llama3.model import count_params_on_meta
from trainer.metrics.fingerprints import FingerprintRecorder, parameter_names
from trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from trainer.launch.launcher_watch import watch_launcher
from trainer.model_build import build_on_meta, materialize, training_model_args
from trainer.parallel import ParallelModel
from trainer.parallel.fsdp import resolve_param_dtype
from trainer.model_build import perturb_weights
from trainer.preflight.checks import RunPlan, check_device_options, plan_run, refuse_record_links
from trainer.checkpoint.seed import create_seed_checkpoint
from trainer.launch.process_exit import DIVERGED, report_error, run_process
from trainer.metrics.profiling import StepProfiler
from trainer.records.safe_writes import LinkRefused
from trainer.step import StepRunner
from trainer.checkpoint.items import TrainState
from trainer.version import code_version

logger = logging.getLogger("trainer")


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global loss (sums to it over data-parallel ranks)
    grad_norm: torch.Tensor  # global gradient norm before clipping
    skipped: bool = False  # float16: the gradients overflowed at this loss scale, no optimizer step


class Trainer:
    """Owns the model, optimizer, data and metrics of one run in this process."""

    def __init__(self, config: JobConfig, plan: RunPlan):
        self.config, self.plan = config, plan
        self.device = process_setup.pick_device()
        check_device_options(config, self.device.type)
        self.rank, world_size = process_setup.init_distributed(
            self.device, config.comm.init_timeout_seconds, *process_setup.flight_recorder(config))
        try:
            self.locks = run_lock.hold(config, self.rank, world_size, self.device)  # before anything is written
        except run_lock.LockRefused as e:
            raise ConfigError(str(e)) from None
        for lock in self.locks:
            if lock.note:
                logger.info("%s", lock.note)
        try:
            refuse_record_links(config)  # as the launcher's preflight, for a trainer started without it
            self._build(config, plan, world_size)
        except BaseException as e:
            if isinstance(e, TrainingComplete) and self.rank == 0:  # a run that stopped after its final save
                run_meta.complete_after_final_save(Path(config.job.dump_folder), config.training.steps,
                                                     exports_written=e.wrote_exports)
            run_lock.release_all(self.locks)
            raise

    def _build(self, config: JobConfig, plan: RunPlan, world_size: int) -> None:
        process_setup.set_determinism(config.debug.seed, config.debug.deterministic, config.debug.deterministic_warn_only)
        self.mesh = plan.dims.build_mesh(self.device.type)
        estimate_before_training(config, plan, self.mesh, self.device)  # memory_estimation.disable_fake_mode
        model_args = training_model_args(config)
        parallel = self._build_model(model_args)
        self.model = parallel.model  # every parameter of this rank, under its original name
        self.float8, self.stages = parallel.float8, list(parallel.stages.values())
        self.runner = StepRunner(parallel, plan, self.mesh, config, self.device)
        self.optimizer = build_optimizer(self.model.named_parameters(), config.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)
        self.loader, self.val_loader = self._build_loaders(model_args.vocab_size)
        self.runner.document_eos = self.loader.document_eos  # document masking: where documents end
        self.source = self.loader.source
        self.loss_scaler = build_loss_scaler(config, resolve_param_dtype(config.training.mixed_precision_param, self.device))
        self.state = TrainState(loss_scaler=self.loss_scaler)
        self.tokens_per_step = plan.global_batch_size * config.training.seq_len
        self.checkpointer = CheckpointManager(
            config, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, loader=self.loader,
            train_state=self.state, rank=self.rank, external_weights=HFWeights(self.model, model_args),
        )
        self.checkpointer.resume()
        if config.debug.init_perturbation and self.state.step == 0:  # never on resume: those weights were trained
            perturb_weights(self.model, config.debug.init_perturbation,
                            resolve_param_dtype(config.training.mixed_precision_param, self.device),
                            config.debug.init_perturbation_seed)

        # The run's record (run_meta.json) first: it decides what metrics.jsonl keeps of earlier starts.
        stamp = self._tensorboard_stamp()
        self.status, self.error = "running", None
        self.stopped_at: int | None = None  # the step saved before stopping on checkpoint.save_on_signal
        self.record = None
        if self.rank == 0:
            self.record = run_meta.begin(Path(config.job.dump_folder), self._metadata(model_args, world_size, stamp),
                                           resumed_step=self.state.step, trajectory=self.checkpointer.trajectory)
            if self.record.get("metrics_from_step"):
                logger.warning("metrics.jsonl starts at step %d: steps 1-%d of the trajectory of %s are not recorded in "
                               "%s", self.state.step + 1, self.state.step, self.checkpointer.start["path"],
                               config.job.dump_folder)
            write_config_file(config)  # job.save_config_file, when set
        self.metrics = MetricsLogger(
            config, rank=self.rank, is_log_rank=self.rank == 0, world_size=world_size, device=self.device,
            flops_per_token=flops_per_token(model_args, config.training.seq_len), run_stamp=stamp,
            purge_step=self.state.step + 1 if self.state.step else None,
        )
        self.metrics_num_params = count_params_on_meta(model_args)
        self.fingerprints = self._fingerprint_recorder(model_args, parallel) if config.metrics.fingerprints else None
        store = dist.distributed_c10d._get_default_store() if world_size > 1 else None
        self.stop = stop_request.StopAgreement(config.checkpoint.save_on_signal, self.checkpointer.saves, store)

    def _build_model(self, model_args) -> ParallelModel:
        parallel = build_on_meta(self.config, self.plan.dims, self.mesh, self.device, model_args)
        materialize(parallel, self.config.debug.seed, self.device)
        return parallel

    def _fingerprint_recorder(self, model_args, parallel: ParallelModel) -> FingerprintRecorder:
        m = self.config.metrics
        return FingerprintRecorder(
            self.model, parallel.stages.values(), self.runner.norm_reduction(), parameter_names(model_args),
            model_args.n_layers, m.fingerprint_first, m.fingerprint_every,
            Path(self.config.job.dump_folder) if self.rank == 0 else None, self.device)

    def _build_loaders(self, vocab_size: int) -> tuple[BatchLoader, BatchLoader | None]:
        config, dims = self.config, self.plan.dims
        train_source, validation_source = build_sources(config, vocab_size)
        eos = document_eos(config, train_source)
        dp_rank = self.mesh["dp"].get_local_rank()
        assert dp_rank == dims.dp_rank_of(self.rank), "device mesh and ParallelDims disagree on the DP rank"
        train = BatchLoader(
            train_source, seq_len=config.training.seq_len, global_batch_size=self.plan.global_batch_size,
            local_batch_size=config.training.local_batch_size, dp_rank=dp_rank, dp_degree=dims.dp, device=self.device,
            accept_data_change=config.checkpoint.accept_data_change, document_eos=eos,
            peers=ProcessGroupPeers(self.device), workers=config.training.dataloader,
        )
        if validation_source is None:
            return train, None
        v = config.validation
        validation = BatchLoader(
            validation_source, seq_len=v.seq_len, global_batch_size=v.global_batch_size,
            local_batch_size=v.local_batch_size, dp_rank=dp_rank, dp_degree=dims.dp, device=self.device,
            name="validation", pad_uneven=True, document_eos=eos, workers=v.dataloader,
        )
        self.validation_batches = evaluation_batches(validation, v.steps)
        return train, validation

    def _tensorboard_stamp(self) -> str | None:
        """Rank 0: the name of the run's TensorBoard subfolder (MetricsLogger hands it to the other
        ranks when they write too). A resumed run keeps the one of its record, so one run's curves
        stay in one folder; a new run, or one on another trajectory, gets the current time."""
        if not self.config.metrics.enable_tensorboard or self.rank != 0:
            return None
        earlier = run_meta.load_record(Path(self.config.job.dump_folder))
        if not run_meta.continues(earlier, self.state.step, self.checkpointer.trajectory):
            earlier = None  # another trajectory's events must not mix with this one's
        folder = (earlier or {}).get("tensorboard")
        return Path(folder).name if folder else time_stamp()

    def _metadata(self, model_args, world_size: int, tensorboard_stamp: str | None) -> dict:
        """This start's part of the run record (see trainer.records.run_meta for the fields)."""
        tensorboard = f"{self.config.metrics.save_tb_folder}/{tensorboard_stamp}" if tensorboard_stamp else None
        return {
            "config": to_dict(self.config),
            "code": code_version(),
            "start": self.checkpointer.start,
            "tensorboard": tensorboard,
            "world_size": world_size,
            "degrees": self.plan.dims.degrees(),
            "global_batch_size": self.plan.global_batch_size,
            "accumulation_steps": self.plan.accumulation_steps,
            "device": str(self.device),
            **process_setup.software_and_device(self.device),
            "argv": sys.argv[1:],
            # which automatic restart of the launcher this start is (torch's agent counts them)
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "num_params": count_params_on_meta(model_args),
            "float8": self.float8.record() if self.float8 else None,
            "data": self.source.describe(),
            "validation_data": self.val_loader.source.describe() if self.val_loader else None,
        }

    def train_step(self, counter: CollectiveCounter | None = None) -> StepResult:
        """One optimizer step. `counter` (metrics.count_collectives) is told which part is running."""
        scaler = self.loss_scaler
        batch = self.loader.next_batch()
        if counter is not None:
            counter.phase = "forward"  # the counter tells the backward pass apart itself
        loss_scale = scaler.scale if scaler else None
        recorder = self.fingerprints if self.fingerprints and self.fingerprints.records(self.state.step) else None
        if recorder is not None:
            recorder.start()
        loss_share = self.runner.forward_backward(batch, loss_scale)
        if recorder is not None:
            recorder.gradients(loss_scale)
        if counter is not None:
            counter.phase = "update"
        if scaler is None:
            grad_norm, skipped = self._clip(), False
            self.optimizer.step()
        else:
            grad_norm, skipped = self._scaled_update(scaler)
        float8.precompute_scales(self.stages, self.float8)  # also after a step skipped for an overflow
        with warnings.catch_warnings():  # torch warns when the first optimizer step was skipped
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()  # also after a skipped step: the schedule follows the step number
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_share, grad_norm, skipped)

    def _clip(self) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), self.config.training.max_norm, self.runner.norm_reduction())

    def _scaled_update(self, scaler: DynamicLossScaler) -> tuple[torch.Tensor, bool]:
        """Unscale, then step unless some gradient overflowed (see trainer.loss_scale). The norm is
        global, so every rank takes the same decision; reading it waits for the device, which
        float16 training pays once per step."""
        unscale_gradients(self.model.parameters(), scaler.scale)
        grad_norm = self._clip()
        finite = bool(torch.isfinite(grad_norm).item())
        scaler.update(finite, self.state.step)
        if finite:
            self.optimizer.step()
        else:
            logger.warning("step %d: gradients overflowed at loss scale %g; step skipped, scale now %g",
                           self.state.step, scaler.scale * 2, scaler.scale)
        return grad_norm, not finite

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Global mean token cross-entropy over the same validation batches every time (all of
        the split with validation.steps = -1)."""
        self.model.eval()
        self.val_loader.reset()
        totals = torch.zeros(2, device=self.device)  # cross-entropy sum, target tokens
        for _ in range(self.validation_batches):
            totals += self.runner.evaluate(self.val_loader.next_batch())
        self.model.train()
        return (totals[0] / totals[1]).item()

    def global_loss(self, result: StepResult) -> float:
        return self.runner.global_sum(result.loss)

    def train(self) -> None:
        cfg = self.config
        if cfg.job.description:
            logger.info("job: %s", cfg.job.description)
        logger.info(
            "training %s (%.2fM parameters) for %d steps: global batch %d x %d tokens (%d accumulation steps)",
            cfg.model.flavor, self.metrics_num_params / 1e6, cfg.training.steps, self.plan.global_batch_size, cfg.training.seq_len,
            self.plan.accumulation_steps,
        )
        if self.source.entropy_floor is not None:
            logger.info("data: %s; best achievable loss %.4f nats/token", cfg.training.dataset, self.source.entropy_floor)
        try:
            with StepProfiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device, self.state.step) as profiler:
                self.run_until(cfg.training.steps, profiler)
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}"
            raise
        if self.stopped_at is not None:
            self.status = "interrupted"
            logger.info("saved step %d on %s and stopped; start the same command again to resume from it",
                        self.stopped_at, self.stop.signal.name)
            return
        self.status = "completed" if self.state.step >= cfg.training.steps else "data ended"
        logger.info("training done: %d steps, %d tokens; outputs in %s", self.state.step, self.state.tokens_seen,
                    os.path.abspath(cfg.job.dump_folder))

    def run_until(self, last_step: int, profiler: StepProfiler | None = None) -> None:
        """Train steps state.step + 1 .. last_step (or until a finite dataset ends); `profiler` is
        told when each step ends."""
        cfg = self.config
        gc.disable()  # collected every gc_freq steps on all ranks at once, not at random moments
        last_log_time, last_log_step = time.perf_counter(), self.state.step
        unchecked: tuple[int, StepResult] | None = None  # a step whose gradient norm is not checked yet
        first_step, data_ended = self.state.step + 1, False
        while self.state.step < last_step:
            self.state.step += 1
            step = self.state.step
            lr = self.scheduler.get_last_lr()[0]
            try:
                result = self._counted_step(step) if step == first_step and cfg.metrics.count_collectives \
                    else self.train_step()
                if self.fingerprints is not None and self.fingerprints.records(step):  # its all-reduce uncounted
                    self.fingerprints.finish(step, result.skipped)
            except DataExhausted as e:
                logger.info("%s; stopping after %d steps", e, step - 1)
                self.state.step -= 1
                data_ended = True
                break
            self.state.tokens_seen += self.tokens_per_step
            stop_at = self.stop.after_step(step)
            stopping = stop_at is not None and step >= stop_at and step < last_step
            # Reading the norm waits for the device. Step t is read once step t+1 is queued, so the
            # device never idles for it; steps whose results are used right away are read at once.
            if unchecked is not None:
                self._check_finite(*unchecked)
            logging_step = should_log(step, cfg.metrics.log_freq, cfg.training.steps) or stopping  # no gap on resume
            evaluating = self.val_loader is not None and (step % cfg.validation.freq == 0 or step == cfg.training.steps)
            saving = self.checkpointer.should_save(step, cfg.training.steps) or stopping
            unchecked = (step, result)
            if logging_step or evaluating or saving or step == last_step:
                self._check_finite(*unchecked)
                unchecked = None
            if step == first_step:  # also after a resume, which starts past step 1
                process_setup.set_collective_timeout(cfg.comm.train_timeout_seconds, keep=self.checkpointer.background_groups())
            if step % cfg.training.gc_freq == 0:
                gc.collect(1)
            if logging_step:
                loss = self.global_loss(result)
                now = time.perf_counter()
                self.metrics.log_step(StepFigures(
                    step=step, loss=loss, grad_norm=result.grad_norm.item(), lr=lr,
                    tokens=(step - last_log_step) * self.tokens_per_step, tokens_seen=self.state.tokens_seen,
                    elapsed_s=now - last_log_time, steps_since_log=step - last_log_step,
                    loss_scale=self.loss_scaler.state_dict() if self.loss_scaler else None, step_skipped=result.skipped,
                ))
                if not math.isfinite(loss):
                    raise NonFiniteLossError(f"step {step}: loss {loss}; stopping")
                if hasattr(self.source, "rows_drawn"):  # a mixture: tokens trained on from each source
                    self.metrics.log_scalars(step, self._tokens_per_source(), prefix="data")
                last_log_time, last_log_step = now, step
            paused = time.perf_counter()  # evaluation, saving and the step delay stay out of the training throughput
            if evaluating:
                self.metrics.log_scalars(step, {"loss": self.validation_loss()}, prefix="validation")
            if saving:
                self._save(step, last=step == cfg.training.steps)
            if cfg.debug.step_delay_s > 0 and not stopping and step < last_step:
                time.sleep(cfg.debug.step_delay_s)
            last_log_time += time.perf_counter() - paused
            if profiler is not None:
                profiler.step(step)
            if stopping:
                self.stopped_at = step
                break
        if unchecked is not None:
            self._check_finite(*unchecked)
        trained = self.state.step >= first_step
        if data_ended and trained:  # the end of the data is the end of the run: evaluate and save it
            if self.val_loader is not None and self.state.step % cfg.validation.freq:
                self.metrics.log_scalars(self.state.step, {"loss": self.validation_loss()}, prefix="validation")
            if self.checkpointer.saves and self.checkpointer.last_saved != self.state.step:
                self._save(self.state.step, last=True)

    def _save(self, step: int, last: bool) -> None:
        """Save step `step`, once every parameter is found finite on every rank (divergence.py)."""
        newest = self.checkpointer.last_saved
        if newest is None and self.checkpointer.start["kind"] == "resume":
            newest = self.checkpointer.start["step"]
        check_parameters(self.model, self.runner.norm_reduction().group, self.device, step, newest,
                         clipping=self.config.training.max_norm > 0)
        self.checkpointer.save(step, last=last)

    def _counted_step(self, step: int) -> StepResult:
        """A training step whose collectives are counted and logged (metrics.count_collectives)."""
        with CollectiveCounter(mesh_group_names(self.mesh)) as counter:
            result = self.train_step(counter)
        p = self.config.parallelism
        pipeline_microbatches = (self.config.training.local_batch_size // p.pipeline_parallel_microbatch_size
                                 if self.plan.dims.pp > 1 else 1)
        summary = counter.summary(forward_passes=self.loader.accumulation_steps * pipeline_microbatches)
        logger.info("collectives of step %d on this rank: %s", step, describe_collectives(summary))
        self.metrics.log_scalars(step, CollectiveCounter.totals(summary), prefix="collectives")
        if self.record is not None:
            self.record["collectives"] = {"step": step, "rank": self.rank, **summary}
            run_meta.write_record(Path(self.config.job.dump_folder), self.record)
        return result

    def _tokens_per_source(self) -> dict[str, int]:
        drawn = self.source.rows_drawn(self.loader.rows_consumed)
        return {f"{name}_tokens": int(rows) * self.config.training.seq_len for name, rows in zip(self.source.names, drawn)}

    def _check_finite(self, step: int, result: StepResult) -> None:
        """(A float16 step skipped for an overflow is expected: its norm is not finite.)"""
        if not result.skipped:
            check_gradient_norm(step, result.grad_norm, self.global_loss(result),
                                clipping=self.config.training.max_norm > 0)

    def close(self, end_process_group: bool = True) -> None:
        """Release what the run holds; `end_process_group` False leaves the process group to
        another run in the same processes."""
        gc.enable()
        for loader in (getattr(self, "loader", None), getattr(self, "val_loader", None)):
            if loader is not None:
                loader.close()  # a streamed source's reading threads and tokenizer processes
        self.checkpointer.wait()
        self.metrics.close(failed=self.error is not None)  # a failed run's W&B run is marked failed
        if self.record is not None:
            status = "failed" if self.error else self.status
            try:
                run_meta.finish(Path(self.config.job.dump_folder), self.record, status, self.state.step, self.error)
            except OSError as e:  # a full or read-only disk: the run's own error says more, keep it
                logger.error("could not write the run's record %s/run_meta.json (status %s): %s",
                             self.config.job.dump_folder, status, e)
        run_lock.release_all(self.locks)
        if end_process_group and dist.is_initialized():
            dist.destroy_process_group()


def configure_logging(stream=None) -> None:
    """A training rank's log (trainer/messages.py), the time first; torchrun and the launcher
    prefix each line with the rank."""
    messages.configure(stream or sys.stdout, timestamps=True)


def main(argv: list[str] | None = None) -> int:
    def stop(error: Exception, code: int = 2) -> int:
        """A user's mistake (2) or a diverged run (3: a non-finite loss, norm or parameter): one
        message, printed by the launcher when there is one (it is in the rank's error.json beside
        its log), else logged here."""
        if not report_error(str(error), code):
            logger.error("%s", error)
        return code

    argv = sys.argv[1:] if argv is None else argv
    watch_launcher()  # first: a rank must not train on after its launcher was killed (trainer/launch/launcher_watch.py)
    # A crash inside a C++ library (SIGSEGV, an abort from a communication thread) kills the
    # process without a Python traceback; this prints every thread's Python stack first.
    faulthandler.enable(file=sys.__stderr__)
    messages.configure(sys.stderr)  # what loading the config says stays off stdout, where --job.print_config writes TOML
    try:
        if "--help" in argv or "-h" in argv:
            rest = [a for a in argv if a not in ("--help", "-h")]
            sys.stdout.write(help_text(load_config(rest) if rest else None) + "\n")
            return 0
        config = load_config(with_default_config(argv))
        if config.job.print_config:
            config.job.print_config = False  # so the printed file trains when loaded back
            sys.stdout.write(to_toml(config))
            return 0
        configure_logging()
        if config.checkpoint.create_seed_checkpoint:
            return create_seed_checkpoint(config)
        plan = plan_run(config, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, CheckpointError) as e:
        return stop(e)
    try:
        trainer = Trainer(config, plan)
    except (ConfigError, DataError, CheckpointError, LinkRefused, RecordError) as e:  # found on the device, or reading files
        return stop(e)
    except TrainingComplete as e:
        logger.info("%s", e)
        return 0
    try:
        trainer.train()
        if trainer.stopped_at is not None:
            report_error(f"saved a checkpoint at step {trainer.stopped_at} on {trainer.stop.signal.name} and stopped; "
                         "start the same command again to resume from it", stop_request.SAVED_AND_STOPPED)
            return stop_request.SAVED_AND_STOPPED
    except (NonFiniteLossError, LossScaleError) as e:
        return stop(e, DIVERGED)
    except (ConfigError, DataError, CheckpointError, LinkRefused, RecordError) as e:  # a stream that cannot be opened, a step folder in the way
        return stop(e)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    run_process(main)

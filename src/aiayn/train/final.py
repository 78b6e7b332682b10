"""The end of a run (rank 0): ``final.pt``, the last step's model, and ``final.json``, what the run did."""

from __future__ import annotations

from aiayn.checkpoint import MODEL_FORMAT, checkpoint_path, save_model
from aiayn.layout import FINAL_MODEL, FINAL_SUMMARY
from aiayn.writing import write_json_atomic


def write_final(trainer, final_dev: dict) -> dict:
    """Write ``final.pt`` and ``final.json`` of ``trainer`` (an ``aiayn.train.trainer.Trainer`` at its last step,
    ``final_dev`` its last dev evaluation); returns the summary."""
    job, progress, settings, data = trainer.job, trainer.progress, trainer.settings, trainer.data
    save_model({"format": MODEL_FORMAT, "model_config": trainer.model_config.to_dict(),
                "model": trainer.model.state_dict(), "vocab_fingerprint": data.vocab_fingerprint,
                "data_fingerprint": data.data_fingerprint, "averaged_steps": [progress.step],
                "averaged_from": [checkpoint_path(trainer.checkpoints.folder, progress.step).name]},
               job.run_dir / FINAL_MODEL)
    summary = {
        "preset": job.preset["name"], "seed": job.seed, "step": progress.step, "epochs": progress.epoch,
        "parameters": trainer.model.num_parameters(), "target_tokens": progress.target_tokens,
        "source_tokens": progress.source_tokens, **progress.per_step(), "train_flops": progress.train_flops,
        "train_hours": progress.elapsed_seconds / 3600, "wall_hours": progress.wall_seconds / 3600,
        "planned_steps": settings.steps,
        "stopped_by": "steps" if progress.step >= settings.steps else "max_minutes",
        "world_size": trainer.world, "device": trainer.device_name, "device_peak_flops": trainer.peak,
        "precision": trainer.precision, **trainer.scaling.record(), "device_tokens": settings.device_tokens,
        **progress.shape_costs(), **trainer.schedule.summary(),
        "mlflow_run_id": trainer.tracker.run_id, "tracking_uri": trainer.tracker.uri, "experiment": job.experiment,
        **final_dev, "dev_history": progress.dev_history, "vocab_fingerprint": data.vocab_fingerprint,
        "data_fingerprint": data.data_fingerprint,
    }
    if trainer.dev.enabled:
        summary["dev_pairs_skipped"] = trainer.dev.pairs_skipped
    fitted = {key: value for key, value in trainer.schedule.summary().items() if isinstance(value, (int, float))}
    trainer.tracker.log_metrics({"train_hours": summary["train_hours"], "parameters": summary["parameters"],
                                 **progress.per_step(), **fitted}, progress.step)
    write_json_atomic(job.run_dir / FINAL_SUMMARY, summary)
    return summary

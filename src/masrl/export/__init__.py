"""``masrl export``: a run's trained policies as standard Hugging Face / PEFT folders (docs/export.md).

    export_run("runs/quickstart-drmas-seed0", out="exported")            # last valid checkpoint
    export_run(run_dir, out=..., step=20, policies=["shared"], merge_lora=True)

Layering: just below the command line. It reads a run folder (``config.yaml``, checkpoints,
``report.json``) through ``masrl.config``, ``masrl.models`` and ``masrl.training.checkpoint``;
only the CLI (``masrl export``) and the trainer's end-of-run hook (``trainer.export: true``, one lazy
import in ``Trainer.fit``) import it.
"""
from masrl.export.core import ExportError, export_run

__all__ = ["ExportError", "export_run"]

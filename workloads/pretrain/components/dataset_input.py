"""The corpus a run trained on, as an MLflow dataset input (the run page's Datasets, the run list's
Dataset column): where it came from, a digest of its text, and its size in tokens.

Rank 0 logs it once per start into ``MLFLOW_RUN_ID`` (a resume logs the same dataset again, which
MLflow keeps as one input). Best-effort, like the metric sink: a tracking error never stops training.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any


def corpus_dataset(name: str, corpus_dir: Path) -> Any:
    """An MLflow ``MetaDataset`` for the cached corpus in ``corpus_dir`` (its ``meta.json``): source
    is ``data.source`` (or the cache directory for the bundled corpus), digest the text's sha256,
    profile the token, document and character counts."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.filesystem_dataset_source import FileSystemDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    meta = json.loads((corpus_dir / "meta.json").read_text())
    where = str(meta.get("source") or corpus_dir)
    with warnings.catch_warnings():
        # MLflow registers its local-file source twice and warns at every path that both match
        # ("can be interpreted in multiple ways: LocalArtifactDatasetSource, LocalArtifactDatasetSource"):
        # one class either way, so the warning says nothing to a user
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        try:
            source: FileSystemDatasetSource = resolve_dataset_source(where)
        except Exception:
            source = resolve_dataset_source(str(corpus_dir))
    profile = {k: meta[k] for k in ("tokens", "documents", "chars", "vocab_size") if k in meta}

    class CorpusDataset(MetaDataset):
        @property
        def profile(self) -> Any:
            return profile

        def to_dict(self) -> dict[str, str]:  # MetaDataset's leaves the profile out
            return {**super().to_dict(), "profile": json.dumps(profile)}

    digest = str(meta.get("text_sha256") or corpus_dir.name)[:16]
    return CorpusDataset(source=source, name=name, digest=digest)


def log_training_corpus(name: str, corpus_dir: Path) -> None:
    """Log the corpus as the run's ``training`` dataset input (no-op outside an llmctl run)."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return
    try:
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.tracking import MlflowClient
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        dataset = corpus_dataset(name, corpus_dir)._to_mlflow_entity()
        MlflowClient().log_inputs(
            run_id, datasets=[DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, "training")])]
        )
    except Exception as e:
        print(f"warning: MLflow dataset input not logged ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

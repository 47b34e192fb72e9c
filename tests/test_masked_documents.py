"""data.documents=masked: samples carry the document ids of the prepared dataset's recorded
document ends. The reference run that the local and Slurm resume tests compare with trains on
them (tests/reference_run.py): there a masked run trains end to end and resumes bit for bit,
and the same job with its SP group as a ring trains the same losses."""

from pathlib import Path

import numpy as np
import pytest
from reference_run import prepared_dataset, train_reference
from slurm_helpers import final_result

from slurm_autosp.config import ConfigError, DocumentBoundaries, load_config
from slurm_autosp.data import open_tokens, write_token_file

REPO = Path(__file__).resolve().parents[1]
MASKED = DocumentBoundaries.masked


def test_samples_number_the_documents_they_cut_from_the_file(tmp_path):
    source = open_tokens(prepared_dataset(tmp_path / "d", [5, 3, 9, 7]), 8, 256, documents=MASKED)
    assert [source.sample(i).document_ids.tolist() for i in range(3)] == [
        [0, 0, 0, 0, 0, 1, 1, 1],  # a document ends exactly where the sample does
        [0, 0, 0, 0, 0, 0, 0, 0],  # inside one document: its middle is a document here
        [0, 1, 1, 1, 1, 1, 1, 1],  # a document's last token, then the next one
    ]
    concat = open_tokens(tmp_path / "d", 8, 256)
    assert concat.sample(0).document_ids is None


def test_masked_documents_need_recorded_document_ends_and_token_data(tmp_path):
    bare = tmp_path / "bare.tokens"
    write_token_file(bare, np.arange(64), 256)
    with pytest.raises(ValueError, match="bare token file records no document ends"):
        open_tokens(bare, 8, 256, documents=MASKED)
    with pytest.raises(ConfigError, match="data.documents=masked needs data.source=tokens"):
        load_config([f"cfg={REPO / 'configs' / 'tiny_cpu.yaml'}", "data.documents=masked"])


@pytest.mark.slow
def test_the_reference_job_with_a_ring_trains_the_ulysses_jobs_losses(
    uninterrupted_run, reference_overrides, tmp_path
):
    """The masked reference (FSDP2, documents of 1 to 400 tokens) with parallel.ring_size=2:
    its 2 ranks are a ring of 2 (Ulysses 1) whose blocks meet within documents; its losses are
    the Ulysses job's (exact in fp32 for the first ten steps; the ring sums in another order,
    which Adam amplifies over the hundred)."""
    ring_run = train_reference(tmp_path, (*reference_overrides, "parallel.ring_size=2"))
    log = next((ring_run / "submitit").glob("*_0_log.out")).read_text()
    assert "AutoSPBackend(sp_size=2, ring_size=2" in log
    ring = final_result(ring_run).losses
    reference = final_result(uninterrupted_run).losses
    assert len(ring) == len(reference)
    errors = [abs(a - b) / abs(b) for a, b in zip(ring, reference, strict=True)]
    print(f"ring vs Ulysses: first 10 steps {max(errors[:10]):.1e}, step 100 {errors[-1]:.1e}")
    assert max(errors[:10]) <= 1e-5, " ".join(f"{e:.1e}" for e in errors[:10])
    assert errors[-1] <= 1e-2 and ring[-1] < ring[0] / 2, (ring[-1], reference[-1])

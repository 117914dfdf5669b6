"""Issue 7: a killed run resumes the data stream where it stopped, not from its beginning."""

import json
import hashlib

import pytest
import torch

from tidar_convert.data import PackedDocuments, ResumableLoader


def fingerprint(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def uneven_rows(tmp_path_factory):
    """Documents of uneven lengths, one .txt file each (read without `datasets`: these tests start
    DataLoader workers dozens of times). The long ones all go to the same reader, so with 2 or 3
    workers the readers end their epoch at different batches, with partial batches in between."""
    path = tmp_path_factory.mktemp("uneven")
    for i in range(20):
        (path / f"{i:03d}.txt").write_text(f"doc {i:03d} " + "word " * (i % 11) + "long " * (15 * (i % 4 == 1)) + "x" * (i % 5))
    return path


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_a_resumed_loader_yields_exactly_the_batches_that_were_still_to_come(tokenizer, uneven_rows, workers):
    """The skip arithmetic, checked at every position of an epoch: consume c batches, save, load into
    a new loader: it yields batches c, c+1, ... of the uninterrupted epoch, in order, and nothing else."""

    def loader():
        ds = PackedDocuments(tokenizer, [str(uneven_rows)], 16, "train", 10, "text", None, "train", 0, shuffle_buffer=4)
        return ResumableLoader(ds, batch_size=3, num_workers=workers)

    whole = loader()
    states, reference = [whole.state_dict()], []
    for batch in whole:
        batch = whole.count(batch)
        reference.append(batch["input_ids"])
        states.append(whole.state_dict())
    sizes = [len(b) for b in reference]
    assert len(reference) >= 12 and (workers < 2 or min(sizes[:-1]) < 3), sizes  # a reader ends before the others
    for c, state in enumerate(states):
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [resumed.count(b)["input_ids"] for b in resumed]
        assert [fingerprint(b) for b in rest] == [fingerprint(b) for b in reference[c:]], f"resumed after {c} batches"
        # the count goes on: a second resume from the end of this one yields nothing more
        assert resumed.state_dict() == states[-1]
    again = [whole.count(b)["input_ids"] for b in whole]  # the next epoch starts from its beginning
    assert [fingerprint(b) for b in again] == [fingerprint(b) for b in reference]


def test_a_position_is_refused_for_other_workers_or_data(tokenizer, uneven_rows):
    def loader(workers=0, seed=0):
        ds = PackedDocuments(tokenizer, [str(uneven_rows)], 16, "train", 10, "text", None, "train", seed)
        return ResumableLoader(ds, batch_size=3, num_workers=workers)

    state = loader(workers=2).state_dict()
    with pytest.raises(ValueError, match="saved with --data.num_workers 2 and this run has 0.*resume with --data.num_workers 2"):
        loader().load_state_dict(state)
    with pytest.raises(ValueError, match="other data settings"):
        loader(workers=2, seed=1).load_state_dict(state)

"""A group re-written by a recovery after its writer died between commit and confirm is not stored twice."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rbpipe.storage import ArrowStorage, ZarrStorage


def test_commit_id_makes_a_second_commit_a_no_op(tmp_path):
    for cls in (ArrowStorage, ZarrStorage):
        path = tmp_path / cls.__name__
        group = TensorDict({"group_id": torch.tensor([1, 1]), "x": torch.randn(2, 3)}, [2])
        first = cls(path)
        assert first.append_group(group, commit_id="claim-1").tolist() == [0, 1]
        recovery = cls(path, create=False)  # another process, after the first writer "died"
        assert recovery.append_group(group, commit_id="claim-1").numel() == 0
        assert recovery.append_group(group, commit_id="claim-2").tolist() == [2, 3]
        assert len(cls(path, create=False)) == 4

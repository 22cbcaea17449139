"""WeakIdMap: keys by identity, never kept alive, dead entries swept without callbacks."""

import gc

import torch

from ampnb._weak import WeakIdMap


def test_keys_by_identity_and_not_kept_alive():
    m = WeakIdMap()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, different tensors
    m[a] = "a"
    assert m.get(a) == "a" and a in m and b not in m and m.get(b, 7) == 7
    assert m.pop(a) == "a" and a not in m and m.pop(a, None) is None
    m[b] = 1
    del b
    gc.collect()
    assert len(m) == 0  # the tensor died; its entry counts for nothing


def test_a_reused_id_is_not_mistaken_for_the_dead_key():
    m = WeakIdMap()
    for _ in range(50):
        t = torch.zeros(1)
        assert t not in m  # a new tensor at a freed address is a new key
        m[t] = True
        del t


def test_dead_entries_are_swept_as_the_map_grows():
    m = WeakIdMap()
    keep = [torch.zeros(1) for _ in range(10)]
    for t in keep:
        m[t] = 1
    for _ in range(5000):
        m[torch.zeros(1)] = 0  # dies at once
    assert len(m._items) < 2100 and all(m.get(t) == 1 for t in keep)

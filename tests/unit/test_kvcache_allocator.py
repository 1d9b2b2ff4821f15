import pytest

from helixserve.kvcache import AllocationError, BlockAllocator, CacheCapacityError, SlotAllocator


@pytest.mark.parametrize("cls", [BlockAllocator, SlotAllocator])
def test_accounting(cls):
    alloc = cls(8)
    assert (alloc.num_free, alloc.num_used) == (8, 0)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(set(a) | set(b)) == 8 and set(a) | set(b) == set(range(8))
    assert (alloc.num_free, alloc.num_used) == (0, 8)
    assert alloc.can_allocate(0) and not alloc.can_allocate(1)
    alloc.free(a)
    assert (alloc.num_free, alloc.num_used) == (3, 5)
    assert sorted(alloc.allocate(3)) == sorted(a)


def test_capacity_error_has_numbers():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(CacheCapacityError, match=r"need 2 blocks, only 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1  # all-or-nothing


@pytest.mark.parametrize("bad", [[0], [99], [-1]])
def test_double_or_foreign_free_raises(bad):
    alloc = SlotAllocator(4)
    ids = alloc.allocate(1)
    alloc.free(ids)
    with pytest.raises(AllocationError):
        alloc.free(bad)
    assert alloc.num_free == 4


def test_duplicate_ids_in_one_free_raise_and_change_nothing():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    with pytest.raises(AllocationError):
        alloc.free([ids[0], ids[0]])
    assert alloc.num_used == 2
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    with pytest.raises(ValueError):
        BlockAllocator(-1)


def test_slots_come_back_lowest_first():
    slots = SlotAllocator(8)
    held = slots.allocate(8)
    assert held == list(range(8))
    slots.free([6, 1, 4])
    slots.free([3])
    assert slots.allocate(3) == [1, 3, 4]  # not last-freed first
    assert slots.allocate(1) == [6] and slots.num_free == 0

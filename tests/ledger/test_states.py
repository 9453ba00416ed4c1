import pytest

from kvport.errors import IllegalMoveError
from kvport.ledger import BlockState, Move, transition


def test_allowed_moves() -> None:
    assert transition(BlockState.ALLOCATED, Move.COMMIT) is BlockState.COMMITTED
    assert transition(BlockState.COMMITTED, Move.BEGIN_TRANSFER) is BlockState.IN_TRANSFER
    assert transition(BlockState.IN_TRANSFER, Move.ABORT_TRANSFER) is BlockState.COMMITTED
    assert transition(BlockState.IN_TRANSFER, Move.COMMIT_TRANSFER_TO_POOL) is BlockState.SHARED
    assert transition(BlockState.SHARED, Move.FORGET) is BlockState.FREED


@pytest.mark.parametrize(("state", "move"), [
    (BlockState.ALLOCATED, Move.HAND_OFF),
    (BlockState.ALLOCATED, Move.BEGIN_TRANSFER),
    (BlockState.IN_TRANSFER, Move.FORGET),
    (BlockState.IN_TRANSFER, Move.HAND_OFF),
    (BlockState.SHARED, Move.BEGIN_TRANSFER),
    (BlockState.SHARED, Move.COMMIT),
    (BlockState.FREED, Move.COMMIT),
    (BlockState.COMMITTED, Move.COMMIT_TRANSFER),
])
def test_illegal_moves_raise(state: BlockState, move: Move) -> None:
    with pytest.raises(IllegalMoveError):
        transition(state, move)

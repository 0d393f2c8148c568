import pytest

from ledger import Account, transfer


def test_deposit():
    a = Account("a")
    a.deposit(50)
    assert a.balance == 50


def test_deposit_rejects_zero():
    with pytest.raises(ValueError):
        Account("a").deposit(0)


def test_transfer_moves_money():
    a, b = Account("a", 100), Account("b")
    transfer(a, b, 30)
    assert (a.balance, b.balance) == (70, 30)

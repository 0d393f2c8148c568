"""Accounts and transfers."""


class InsufficientFunds(Exception):
    """The source account cannot cover the amount."""


class Account:
    """An account with an integer balance in cents."""

    def __init__(self, name: str, balance: int = 0) -> None:
        self.name = name
        self.balance = balance

    def deposit(self, amount: int) -> None:
        """Add amount (> 0) to the balance."""
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.balance += amount


def transfer(src: Account, dst: Account, amount: int) -> None:
    """Move amount from src to dst."""
    src.balance -= amount
    dst.balance += amount

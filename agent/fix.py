"""`m3-agent fix`: fix an issue in a repository."""

from agent.errors import UsageError


def fix_command(repo: str = ".") -> None:
    """Fix an issue."""
    raise UsageError(f"not yet: {repo}")

"""`python -m agent.context ...`: the `m3-agent pack` command."""

from m3_agent.agent.context.cli import main

if __name__ == "__main__":
    main(own_process=True)

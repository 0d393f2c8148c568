"""The agent: the loop, the model client, thinking modes, stall detection, trajectories and the
repository context (`m3_agent.agent.context`)."""

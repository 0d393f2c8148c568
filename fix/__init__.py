"""`m3-agent fix`: the command, the issue sources (GitHub's REST API) and the host-side git work
(the clean copy the agent works on, the branch and the commit it hands back)."""

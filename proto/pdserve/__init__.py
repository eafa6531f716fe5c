"""pdserve: wire schemas (`pdserve.v1`) and the project-wide environment (`pdserve.envs`)."""

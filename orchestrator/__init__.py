"""Orchestrator: runs the speculate -> verify -> accept loop per request and serves
the public OrchestratorService.Generate stream; scales its replica pools through a
launcher (on Ray: specd/ray_deploy.py)."""

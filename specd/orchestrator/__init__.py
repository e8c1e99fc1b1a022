"""Orchestrator: runs the speculate -> verify -> accept loop per request and serves
the public OrchestratorService.Generate stream; deploys replicas on Ray."""

"""What specd's three services share, as layers (each imports only the ones
before it): errors, rules, runtime, telemetry, api, net. See
docs/architecture.md for the graph and what each layer holds."""

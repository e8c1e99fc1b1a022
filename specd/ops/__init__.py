"""Operations tooling on top of the services: the `specd` command line (cli),
the Ray cluster it starts or joins (ray_cluster), the replicas as Ray actors
(ray_deploy), the services as local processes for tests and benchmarks
(local_stack) and stub generation (protogen)."""

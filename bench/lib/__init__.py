"""What the benchmarks share: daemons, S3 servers, the physical limits of the machine, reports."""

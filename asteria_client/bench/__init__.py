"""`asteria bench`: benchmarks that measure Asteria's claims as ratios taken side by side."""

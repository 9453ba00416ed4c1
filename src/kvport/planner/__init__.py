"""Transfer vs recompute vs compress: cost model and calibration profile."""

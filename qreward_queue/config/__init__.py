"""The configuration: what the files say as frozen values (`model`), the loader that reads and
checks `qrq.toml` and `workers/*.toml` (`loader`), the TOML reader that names file and key
(`toml_table`), Redis URLs and Sentinel groups as connections (`redis_conn`) and which extra
brings each optional dependency (`extras`)."""

"""`python -m bench report`: the benchmarks page's tables from result records. records (the JSON
records and their checks) < areas (each table's columns) < tables (markdown) < page (the generated
blocks in a page) and compare (a compare.sh folder as a record) < command (the subcommand)."""

"""The launcher's planning side: what fits on this machine for a model and its settings, what each setting
costs in quality (from the .mcapy file's measured table), and the `decapybara serve` command that runs it.
`capacity` is the pure arithmetic, `probe` measures the machine, `cli_plan` is `decapybara plan`."""

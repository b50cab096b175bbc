"""How every command declares and reads its options, below everything else: `option()` fields with their one line
of help and their checks (option.py), command-line flags generated from them (flags.py), and YAML recipes read with
their bases (recipes.py). Nothing here imports torch or another floor of fastanchor: a command that only declares
flags imports this and nothing heavier. The training configuration these build (`Config`) is trainer/config.py."""

from p2ptrain.cli import entry_point

entry_point()

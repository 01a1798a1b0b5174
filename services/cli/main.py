def main() -> None:
    raise SystemExit("k3: not implemented yet")

from onnxfuse.cli import main

main()

"""``onnxfuse bench MODEL [MODEL2]``: time one model, or two side by side, on ONNX Runtime."""

from __future__ import annotations


import click

from onnxfuse import api, model_io
from onnxfuse.cli import render
from onnxfuse.cli.common import (verbosity_options, EXIT_CODES_HELP, check_runtime, emit_json, handle_errors, input_options, json_option,
                                 range_map, report_console, report_file, write_failure_json)
from onnxfuse.reports.files import check_report_paths, json_text, write_text
from onnxfuse.runtime.inputs import parse_shape_options

BENCH_HELP = """Time MODEL (and MODEL2, side by side) on ONNX Runtime.

Each model runs with ONNX Runtime's own optimizations on (ORT_ENABLE_ALL), inputs and outputs bound in
GPU memory (IOBinding), after warm-up runs; timed runs go on until --iterations or --time-budget is
reached, whichever comes first. With two models, runs alternate between them in rounds so both see
the same GPU conditions. Reports median, p90, p99, min and mean latency in milliseconds.

Timing needs a CUDA GPU: without one, bench says so in one line and exits with 1, unless --device cpu.

\b
Examples:
  onnxfuse bench model.onnx
  onnxfuse bench model.onnx model.opt.onnx --batch 16
  onnxfuse bench model.onnx model.opt.onnx --cuda-graph --time-budget 5 \\
      --json bench.json
  onnxfuse bench bert.onnx --shape input_ids:8,128 \\
      --shape attention_mask:8,128 --profile
  onnxfuse bench model.onnx --device cpu --iterations 100 --warmup 5
  onnxfuse bench model.onnx model.opt.onnx --batch 16 --sessions 3
"""


@click.command(help=BENCH_HELP, epilog=EXIT_CODES_HELP)
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.argument("model2_path", metavar="[MODEL2]", required=False, type=click.Path(dir_okay=False))
@click.option("--batch", type=int, default=None, metavar="N",
              help="Batch size: sets every input's first dynamic dimension (other dynamic ones default to 1).")
@input_options
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Where to time. cpu results are labelled CPU and say nothing about the GPU.")
@click.option("--cuda-graph", is_flag=True, help="Capture the run in a CUDA graph and replay it (CUDA only; not for models with "
              "If/Loop/Scan, such as KV-cache decoders optimized with DecodeAttention).")
@click.option("--iterations", type=int, default=None, metavar="N", help="Stop after N timed runs (per model).")
@click.option("--warmup", type=int, default=10, show_default=True, metavar="N", help="Untimed runs first.")
@click.option("--time-budget", "time_budget", type=float, default=2.0, show_default=True, metavar="SECONDS",
              help="Stop timing a model after this long (at least 10 runs are made).")
@click.option("--sessions", type=int, default=1, show_default=True, metavar="N",
              help="Repeat in N fresh sessions per model (budget split, samples pooled): evens out "
                   "cuDNN's per-session algorithm choice.")
@click.option("--profile", "do_profile", is_flag=True,
              help="Also profile each model: top ops by time and by count, nodes (and kernels) per run.")
@click.option("--top", type=int, default=10, show_default=True, help="Rows in the --profile tables.")
@json_option("Also write the results as JSON (schema: onnxfuse/reports/schemas/report.schema.json).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success (errors still go to stderr).")
@verbosity_options
@handle_errors
def bench(model_path, model2_path, batch, shapes, inputs_path, seed, input_ranges, device, cuda_graph, iterations, warmup,
          time_budget, sessions, do_profile, top, json_path, quiet) -> None:
    read = {**model_io.input_files(model_path, "model"), **model_io.input_files(model2_path, "second model")}
    try:
        check_runtime(quiet)
        check_report_paths({report_file(json_path): "JSON report"}, read)
        with render.progress_bar(disabled=quiet) as bar:
            report = api.bench(
                model_path, model2_path, inputs=inputs_path, batch=batch, shapes=parse_shape_options(shapes),
                seed=seed, input_ranges=range_map(input_ranges), device=device, cuda_graph=cuda_graph,
                iterations=iterations, warmup=warmup, time_budget=time_budget, sessions=sessions,
                profile=do_profile, top=top, progress=bar.fraction,
            )
    except Exception as exc:  # an internal error too: its document says exit 5, as stderr does
        write_failure_json(json_path, "bench", exc, read)
        raise

    if report_file(json_path):
        write_text(json_path, json_text(report), what="JSON report")
    emit_json(json_path, json_text(report))
    if quiet:
        return
    stdout = report_console(json_path)
    results = report.results
    mode = "CUDA, IOBinding" if device == "cuda" else "CPU"
    title = f"Latency ({mode}{', CUDA graph' if cuda_graph else ''}, ORT_ENABLE_ALL)"
    stdout.print(render.latency_table(results, title))
    for note in report.notes:
        render.print_prose(stdout, note, "note: ", "[yellow]note:[/] ")
    sp = report.speedup
    if sp is not None:
        faster = "faster" if sp >= 1 else "slower"
        ratio = sp if sp >= 1 else 1 / sp
        stdout.print(f"{results[1].name} is {ratio:.2f}× {faster} than {results[0].name} (median, {mode})")
    for prof in report.profiles:
        for table in render.profile_tables(prof, top):
            stdout.print(table)
        for note in prof.summary.notes:
            render.print_prose(stdout, note, "note: ", "[dim]note:[/] ")

"""`fastddrive plan`: one scene planned by one decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fastddrive.cli.common import app, console, user_errors


@app.command("plan")
def plan_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    data: Annotated[Path | None, typer.Option(help="Dataset folder to take the scene from.")] = None,
    split: Annotated[str, typer.Option(help="train, val or test (with --data).")] = "test",
    index: Annotated[int, typer.Option(help="Sample index in the split (with --data).")] = 0,
    image: Annotated[
        list[Path] | None, typer.Option(help="Camera image (PNG or JPEG, any size); repeat for several.")
    ] = None,
    camera: Annotated[
        list[str] | None,
        typer.Option(help="NAME=PATH: one camera of a model that takes separate cameras (FRONT=front.jpg); repeat."),
    ] = None,
    history: Annotated[
        str | None, typer.Option(help="Ego history: JSON text or a .json file, 7 rows of \\[x, y, vx, vy, ax, ay].")
    ] = None,
    command: Annotated[str | None, typer.Option(help="go_straight, go_left or go_right.")] = None,
    decoder: Annotated[str, typer.Option(help="A registered decoder (ar, fullseq, mdm, sd, selfspec, ...).")] = "ss",
    option: Annotated[
        list[str] | None,
        typer.Option(help="Decoder option KEY=VALUE (tau=0.5); repeatable. --show-options lists each one's range."),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on a GPU).")
    ] = None,
    image_max_pixels: Annotated[
        int | None,
        typer.Option(
            min=784, max=4096 * 4096, help="Resize frames to at most this many pixels (default: the model folder's)."
        ),
    ] = None,
    image_min_pixels: Annotated[
        int | None,
        typer.Option(
            min=784, max=4096 * 4096, help="Resize frames to at least this many pixels (default: the model folder's)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the summary.")] = False,
    show_options: Annotated[
        bool, typer.Option("--show-options", help="List the options of --decoder with their ranges and defaults.")
    ] = False,
) -> None:
    """Plan one scene: from a dataset (--data/--split/--index) or from --image/--history/--command.

    Options, scene and the decode's estimated memory are checked before the model's weights load."""
    import fastddrive
    from fastddrive.core.inputs import read_history, read_image
    from fastddrive.core.outputs import finite_json
    from fastddrive.core.sample import SampleError, check_pixel_range
    from fastddrive.data.dataset import DrivingDataset
    from fastddrive.decode.registry import get_decoder, parse_options
    from fastddrive.engine.model_files import model_path, read_info
    from fastddrive.planner import camera_images, check_before_loading

    with user_errors():
        get_decoder(decoder)
        if show_options:
            _print_options(decoder)
            return
        options = parse_options(option or [], decoder)
        if data is not None:
            if image or history or command:
                raise SampleError("give either --data or --image/--history/--command, not both")
            scene = DrivingDataset.open(data).sample(split, index)
        else:
            if history is None or command is None:
                raise SampleError("without --data, --history and --command are required (and --image for a VLM)")
            images = [read_image(p) for p in image or []]
            if camera:
                if image:
                    raise SampleError("give either --image or --camera NAME=PATH, not both")
                named = dict(_camera(c) for c in camera)
                if len(named) < len(camera):
                    raise SampleError("a camera is given twice with --camera")
                images = camera_images(
                    {k: read_image(v) for k, v in named.items()}, read_info(model_path(model)).cameras
                )
            scene = fastddrive.PlanInputs.checked(images=images, history=read_history(history), command=command)
        from fastddrive.eval.roofline import parse_dtype

        weights = parse_dtype(dtype) if dtype else None
        options = check_before_loading(model, decoder, options, device, weights, scene)
        if image_min_pixels and image_max_pixels:
            check_pixel_range(image_min_pixels, image_max_pixels, ("--image-min-pixels", "--image-max-pixels"))
        planner = fastddrive.load(
            model, device=device, dtype=weights, image_min_pixels=image_min_pixels, image_max_pixels=image_max_pixels
        )
        result = planner.plan(scene, decoder, **options)
    if as_json:
        print(finite_json(result.to_json()))
        if result.response is None:  # the JSON says why (its "error"); the status says it failed
            raise typer.Exit(1)
        return
    table = Table(title=f"{decoder} on {model}")
    for column in ("NFE", "tokens", "tokens/NFE", "prefill ms", "decode ms", "tokens/s"):
        table.add_column(column, justify="right")
    table.add_row(
        str(result.nfe),
        str(result.tokens),
        f"{result.tokens_per_nfe:.2f}",
        f"{result.prefill_ms:.1f}",
        f"{result.decode_ms:.1f}",
        f"{result.tokens_per_s:.0f}",
    )
    console.print(table)
    console.print(result.text, highlight=False, soft_wrap=True)
    if result.response is None:
        Console(stderr=True).print(f"[bold red]the answer does not parse:[/] {result.error}", highlight=False)
        raise typer.Exit(1)


def _camera(text: str) -> tuple[str, Path]:
    """NAME=PATH of --camera."""
    from fastddrive.core.sample import SampleError

    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SampleError(f"--camera {text!r}: give NAME=PATH, e.g. FRONT=front.jpg")
    return name, Path(path)


def _print_options(decoder: str) -> None:
    from fastddrive.decode.options import option_table

    table = Table(title=f"options of {decoder} (--option KEY=VALUE)")
    for column in ("option", "takes", "default"):
        table.add_column(column)
    for key, takes, default in option_table(decoder):
        table.add_row(key, takes, str(default))
    console.print(table)

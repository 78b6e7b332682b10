import json

from aiayn.report import base_preset

# The row every Table 3 row is tested against, and whose model the attention pictures show.
REPORT_BASE = base_preset(PRESETS)
REPORT = f"{RESULTS}/report"


rule report:
    input:
        # one file per run, every list in the order of runs(): the report pairs them by position
        runs=for_every_run(rules.train.output.final),
        dev_scores=for_every_run(rules.score.output[0], split="dev"),
        test_scores=for_every_run(rules.score.output[0], split="test"),
        dev_translations=for_every_run(rules.decode.output[0], split="dev"),
        averages=for_every_run(rules.average.output.summary),
        dev_references=data_text("dev", TGT),
        dev_sources=data_text("dev", SRC),  # the first few join the paper's two on the attention explorer
        attention_model=for_run(rules.average.output.model, {"model": REPORT_BASE, "seed": config["seeds"][0]}),
        spm_model=rules.bpe.output.model,
    output:
        table2_csv=report(f"{REPORT}/{layout.TABLE2}.csv", caption="../report/table2.rst", category="Tables"),
        table2_md=report(f"{REPORT}/{layout.TABLE2}.md", caption="../report/table2.rst", category="Tables"),
        table3_csv=report(f"{REPORT}/{layout.TABLE3}.csv", caption="../report/table3.rst", category="Tables"),
        table3_md=report(f"{REPORT}/{layout.TABLE3}.md", caption="../report/table3.rst", category="Tables"),
        dev_ppl=report(f"{REPORT}/{layout.DEV_PPL_FIGURE}", caption="../report/dev_ppl.rst", category="Figures"),
        # each preset's runs over its reference's seed band (train.reference)
        dev_ppl_band=[f"{REPORT}/{layout.band_figure_name(name)}" for name in PRESETS],
        table3_bleu=report(
            f"{REPORT}/{layout.TABLE3_BLEU_FIGURE}", caption="../report/table3_bleu.rst", category="Figures"
        ),
        attention_long_distance=report(
            f"{REPORT}/{layout.ATTENTION_LONG_DISTANCE_FIGURE}",
            caption="../report/attention_long_distance.rst",
            category="Attention",
        ),
        attention_anaphora=report(
            f"{REPORT}/{layout.ATTENTION_ANAPHORA_FIGURE}",
            caption="../report/attention_anaphora.rst",
            category="Attention",
        ),
        attention_explorer=report(
            f"{REPORT}/{layout.ATTENTION_EXPLORER}",
            caption="../report/attention_explorer.rst",
            category="Attention",
        ),
    params:
        # the presets in the order of `models` (the tables' order), each preset's keys sorted, so that
        # reordering the keys of a config file changes no params (which would rerun the report)
        presets=json.dumps({name: json.loads(to_json(preset)) for name, preset in PRESETS.items()},
                           separators=(",", ":")),
        out_dir=lambda w, output: Path(output.table3_csv).parent,
        base=REPORT_BASE,
        decode=output_settings("decode"),  # the explorer's translations are searched as the decode stage's
        tracking_uri=config["tracking_uri"],
    log:
        log_file("report"),
    resources:
        mem_mb=4000,
        runtime=20,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "report " f"--config {SETTINGS} " "--out-dir {params.out_dir} --base {params.base} "
        "--runs {input.runs} --dev-scores {input.dev_scores} --test-scores {input.test_scores} "
        "--dev-translations {input.dev_translations} --dev-references {input.dev_references} "
        "--averages {input.averages} "
        "--attention-model {input.attention_model} --spm-model {input.spm_model} "
        "--explorer-dev {input.dev_sources}"

import json

from aiayn.report import base_preset

# The row every Table 3 row is tested against, and whose model the attention pictures show.
REPORT_BASE = base_preset(PRESETS)
REPORT = f"{RESULTS}/report"


rule report:
    input:
        scores=score_outputs(),
        runs=[f"{RESULTS}/train/{model}/seed{seed}/final.json" for model, seed in runs()],
        dev_translations=[f"{RESULTS}/decode/{model}/seed{seed}/dev.{TGT}" for model, seed in runs()],
        dev_references=f"{RESULTS}/data/dev.{TGT}",
        attention_model=f"{RESULTS}/average/{REPORT_BASE}/seed{config['seeds'][0]}/model.pt",
        spm_model=rules.bpe.output.model,
    output:
        table2_csv=report(f"{REPORT}/table2.csv", caption="../report/table2.rst", category="Tables"),
        table2_md=report(f"{REPORT}/table2.md", caption="../report/table2.rst", category="Tables"),
        table3_csv=report(f"{REPORT}/table3.csv", caption="../report/table3.rst", category="Tables"),
        table3_md=report(f"{REPORT}/table3.md", caption="../report/table3.rst", category="Tables"),
        dev_ppl=report(f"{REPORT}/dev_ppl.png", caption="../report/dev_ppl.rst", category="Figures"),
        table3_bleu=report(f"{REPORT}/table3_bleu.png", caption="../report/table3_bleu.rst", category="Figures"),
        attention_long_distance=report(
            f"{REPORT}/attention_long_distance.png",
            caption="../report/attention_long_distance.rst",
            category="Attention",
        ),
        attention_anaphora=report(
            f"{REPORT}/attention_anaphora.png", caption="../report/attention_anaphora.rst", category="Attention"
        ),
    params:
        # not to_json, which sorts the keys: the tables keep the order of `models` in the config
        presets=json.dumps(PRESETS, separators=(",", ":")),
        # derived from the files, not written out again, so that they can never disagree with them
        out_dir=lambda w, output: Path(output.table3_csv).parent,
        results=lambda w, input: Path(input.dev_references).parent.parent,
        seeds=config["seeds"],
        base=REPORT_BASE,
        tgt_lang=TGT,
        tracking_uri=config["tracking_uri"],
    log:
        f"{RESULTS}/logs/report.log",
    resources:
        mem_mb=4000,
        runtime=20,
        attempt=attempt_number,
    shell:
        "aiayn --log {log} --attempt {resources.attempt} "
        "report --presets-json {params.presets:q} --results {params.results} --out-dir {params.out_dir} "
        "--seeds {params.seeds} --base {params.base} --tgt-lang {params.tgt_lang} "
        "--attention-model {input.attention_model} --spm-model {input.spm_model} "
        "--tracking-uri {params.tracking_uri:q}"

rule report:
    input:
        scores=score_outputs(),
        runs=[f"{RESULTS}/train/{model}/seed{seed}/final.json" for model, seed in runs()],
    output:
        report_outputs(),
    params:
        presets=to_json(PRESETS),
        out_dir=f"{RESULTS}/report",
        results=RESULTS,
        seeds=config["seeds"],
    log:
        f"{RESULTS}/logs/report.log",
    resources:
        mem_mb=4000,
        runtime=20,
    shell:
        "aiayn report --presets-json {params.presets:q} --results {params.results} --out-dir {params.out_dir} --seeds {params.seeds} > {log} 2>&1"

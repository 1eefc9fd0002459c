import createClient from "openapi-fetch";
import type { components, paths } from "./loraloom.js";

type Sample = components["schemas"]["TrainingSample"];

export async function main(baseUrl: string, apiKey: string, examples: Sample[]): Promise<ArrayBuffer> {
  const client = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${apiKey}` } });

  const created = await client.POST("/v1/runs", {
    body: { name: "ts-run", config: { max_steps: 50, lora: { rank: 8 } } },
  });
  if (created.error) throw new Error(`${created.error.error.code}: ${created.error.error.message}`);
  const run = created.data;

  const batch = await client.POST("/v1/runs/{run_id}/batches", {
    params: { path: { run_id: run.id } },
    body: { examples, step: 0 },
  });
  if (batch.error) throw new Error(batch.error.error.code);

  const adapter = await client.GET("/v1/runs/{run_id}/adapters/{step}", {
    params: { path: { run_id: run.id, step: "latest" } },
    parseAs: "arrayBuffer",
  });
  if (adapter.error) throw new Error(adapter.error.error.code); // e.g. "adapter_not_found" before the first step
  return adapter.data; // the adapter's tar.gz; adapter.response.headers.get("ETag") for If-None-Match
}

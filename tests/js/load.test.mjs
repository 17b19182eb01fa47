// Bounded concurrent load: 64 streaming requests at once on the tiny model. Every stream must complete with a
// finish_reason, and requests with equal seeds must produce equal text whatever the interleaving.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const { BASE_URL, API_KEY, MODEL } = process.env;
const client = new OpenAI({ baseURL: `${BASE_URL}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 600_000 });

test('64 concurrent streaming requests', { timeout: 600_000 }, async () => {
  const N = 64;
  const run = async (i) => {
    const stream = await client.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: `Request ${i % 4}` }], seed: i % 4, max_tokens: 6,
      max_denoising_steps: 2, stream: true, stream_options: { include_usage: true },
    });
    let content = '';
    let finish = null;
    let usage = null;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      content += chunk.choices[0]?.delta?.content ?? '';
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    return { i, content, finish, usage };
  };
  const results = await Promise.all(Array.from({ length: N }, (_, i) => run(i)));
  for (const r of results) {
    assert.ok(['stop', 'length'].includes(r.finish), `request ${r.i}: ${r.finish}`);
    assert.ok(r.usage && r.usage.completion_tokens <= 6, `request ${r.i}`);
  }
  for (const r of results) assert.equal(r.content, results[r.i % 4].content, `request ${r.i} differs from its seed twin`);
  const health = await fetch(`${BASE_URL}/health`).then((r) => r.json());
  assert.equal(health.queue_depth, 0);
});

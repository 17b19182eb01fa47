// curl-level protocol checks: malformed and oversize bodies, wrong types, auth, unknown routes, a fuzzed corpus of
// bad requests (the server must answer each with an OpenAI error and stay up), and metrics.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';

const { BASE_URL, API_KEY, MODEL } = process.env;

// Returns { status, json, text } for a curl invocation (body from stdin so any bytes can be sent).
function curl(path, { method = 'POST', body, key = API_KEY, headers = [] } = {}) {
  const args = ['-s', '-o', '-', '-w', '\n%{http_code}', '-X', method, `${BASE_URL}${path}`];
  if (key) args.push('-H', `Authorization: Bearer ${key}`);
  if (body !== undefined) args.push('-H', 'Content-Type: application/json', '--data-binary', '@-');
  for (const h of headers) args.push('-H', h);
  const out = execFileSync('curl', args, { input: body ?? '', maxBuffer: 1 << 26 }).toString();
  const nl = out.lastIndexOf('\n');
  const text = out.slice(0, nl);
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: Number(out.slice(nl + 1)), json, text };
}

function assertError(r, status, param, code) {
  assert.equal(r.status, status, r.text);
  assert.ok(r.json?.error, r.text);
  assert.equal(typeof r.json.error.message, 'string');
  assert.equal(typeof r.json.error.type, 'string');
  if (param !== undefined) assert.equal(r.json.error.param, param, r.text);
  if (code !== undefined) assert.equal(r.json.error.code, code, r.text);
}

const chat = (extra = {}) => JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4,
                                              max_denoising_steps: 2, seed: 1, ...extra });

test('health and models are JSON', () => {
  const h = curl('/health', { method: 'GET' });
  assert.equal(h.status, 200);
  assert.equal(h.json.status, 'ok');
  const m = curl('/v1/models', { method: 'GET' });
  assert.equal(m.json.data[0].id, MODEL);
});

test('malformed JSON is 400 invalid_json', () => {
  assertError(curl('/v1/chat/completions', { body: '{"messages": [' }), 400, null, 'invalid_json');
  assertError(curl('/v1/chat/completions', { body: '' }), 400, null, 'invalid_json');
});

test('oversize body is 413', () => {
  const big = chat({ padding: 'x'.repeat(100 * 1024) });
  assertError(curl('/v1/chat/completions', { body: big }), 413, null, 'request_too_large');
});

test('wrong types name the field', () => {
  assertError(curl('/v1/chat/completions', { body: chat({ max_tokens: '4' }) }), 400, 'max_tokens', 'invalid_type');
  assertError(curl('/v1/chat/completions', { body: chat({ stream: 1 }) }), 400, 'stream', 'invalid_type');
  assertError(curl('/v1/chat/completions', { body: JSON.stringify({ messages: 'hi' }) }), 400, 'messages', 'invalid_type');
  assertError(curl('/v1/chat/completions', { body: chat({ messages: [{ role: 'user', content: 42 }] }) }), 400,
    'messages[0].content', 'invalid_type');
  assertError(curl('/v1/completions', { body: JSON.stringify({ prompt: { text: 'x' } }) }), 400, 'prompt', 'invalid_type');
});

test('unknown model is 404, missing or wrong key is 401, unknown route is 404', () => {
  assertError(curl('/v1/chat/completions', { body: chat({ model: 'nope' }) }), 404, 'model', 'model_not_found');
  assertError(curl('/v1/chat/completions', { body: chat(), key: '' }), 401, null, 'invalid_api_key');
  assertError(curl('/v1/chat/completions', { body: chat(), key: 'bad' }), 401, null, 'invalid_api_key');
  assertError(curl('/v1/embeddings', { body: '{}' }), 404, null, 'unknown_url');
});

test('curl -N streaming is SSE ending in [DONE]', () => {
  const r = curl('/v1/chat/completions', { body: chat({ stream: true }) });
  assert.equal(r.status, 200);
  const events = r.text.split('\n\n').filter(Boolean);
  assert.equal(events.at(-1), 'data: [DONE]');
  for (const e of events.slice(0, -1)) assert.equal(JSON.parse(e.slice(6)).object, 'chat.completion.chunk');
});

test('fuzzed bad requests get errors and the server stays up', () => {
  const corpus = [
    'null', '[]', '"x"', '1e999', '{"messages":null}', '{"messages":[null]}', '{"messages":[[]]}',
    '{"messages":[{"role":7}]}', '{"messages":[{"role":"user","content":[{"type":"text"}]}]}',
    '{"messages":[{"role":"user","content":"x"}],"tools":[1]}',
    '{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":5}}]}',
    '{"messages":[{"role":"user","content":"x"}],"stop":{"a":1}}',
    '{"messages":[{"role":"user","content":"x"}],"seed":1.5}',
    '{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}',
    '{"messages":[{"role":"user","content":"x"}],"max_tokens":1e300}',
    '{"messages":[{"role":"user","content":"x"}],"stream_options":[]}',
    '{"messages":[{"role":"user","content":"x"}],"tool_choice":5}',
    '{"messages":[{"role":"assistant","tool_calls":"x"}]}',
    '{"messages":[{"role":"user","content":"x"}],"x_test_output":5}',
    '{"messages":[{"role":"user","content":"\\ud800"}]}',
    '{"prompt":[1,2,"3"]}', '{"messages":[{"role":"user","content":"x"}]' + ']'.repeat(100),
    '['.repeat(10000), '\u0000\u0001\u0002', '{"messages":[{"role":"user","content":"x"}],}',
  ];
  for (const body of corpus) {
    for (const path of ['/v1/chat/completions', '/v1/completions']) {
      const r = curl(path, { body });
      assert.ok(r.status >= 400 && r.status < 500, `${path} ${body.slice(0, 60)} -> ${r.status} ${r.text}`);
      assert.ok(r.json?.error?.message, `${path} ${body.slice(0, 60)}: ${r.text}`);
    }
  }
  assert.equal(curl('/health', { method: 'GET' }).status, 200);
});

test('metrics are Prometheus text with the documented series', () => {
  const r = curl('/metrics', { method: 'GET' });
  assert.equal(r.status, 200);
  for (const name of ['diffgemma_requests_total', 'diffgemma_completion_tokens_total', 'diffgemma_kv_reuse_hits_total',
    'diffgemma_queue_depth', 'diffgemma_steps_per_block_bucket', 'diffgemma_step_seconds_bucket']) {
    assert.match(r.text, new RegExp(`^${name}`, 'm'), name);
  }
  assert.match(r.text, /diffgemma_requests_total\{endpoint="chat",status="400"\} [1-9]/);
});

// The official openai SDK against `diffgemma serve` on the tiny random-weight model: the text is meaningless, so
// these check structure, determinism per seed, stream == non-stream, and protocol round trips.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const { BASE_URL, API_KEY, MODEL } = process.env;
const client = new OpenAI({ baseURL: `${BASE_URL}/v1`, apiKey: API_KEY, maxRetries: 0, timeout: 120_000 });
const small = { max_tokens: 12, max_denoising_steps: 3 };
const ask = (content, extra = {}) => ({
  model: MODEL,
  messages: [{ role: 'user', content }],
  ...small,
  ...extra,
});

async function collect(stream) {
  const out = { content: '', chunks: [], drafts: [], usage: null, finish: null, toolCalls: [] };
  for await (const chunk of stream) {
    if (chunk.event === 'draft') { out.drafts.push(chunk.data); continue; }
    out.chunks.push(chunk);
    if (chunk.usage) out.usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (choice.delta?.content) out.content += choice.delta.content;
    for (const tc of choice.delta?.tool_calls ?? []) out.toolCalls.push(tc);
    if (choice.finish_reason) out.finish = choice.finish_reason;
  }
  return out;
}

test('models.list names the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
});

test('non-streaming chat: shape, usage, determinism per seed', async () => {
  const a = await client.chat.completions.create(ask('Hello!', { seed: 11 }));
  const b = await client.chat.completions.create(ask('Hello!', { seed: 11 }));
  assert.equal(a.object, 'chat.completion');
  assert.equal(a.model, MODEL);
  assert.match(a.id, /^chatcmpl-/);
  const msg = a.choices[0].message;
  assert.equal(msg.role, 'assistant');
  assert.equal(typeof msg.content, 'string');
  assert.ok(['stop', 'length'].includes(a.choices[0].finish_reason));
  assert.ok(a.usage.completion_tokens >= 1 && a.usage.completion_tokens <= 12);
  assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + a.usage.completion_tokens);
  assert.equal(b.choices[0].message.content, msg.content);
  assert.equal(b.usage.completion_tokens, a.usage.completion_tokens);
  const c = await client.chat.completions.create(ask('Hello!', { seed: 12, max_tokens: 24 }));
  const d = await client.chat.completions.create(ask('Hello!', { seed: 13, max_tokens: 24 }));
  assert.notEqual(c.choices[0].message.content, d.choices[0].message.content);
});

test('streaming chat equals non-streaming and ends with usage', async () => {
  const whole = await client.chat.completions.create(ask('Stream me.', { seed: 21 }));
  const s = await collect(await client.chat.completions.create(
    ask('Stream me.', { seed: 21, stream: true, stream_options: { include_usage: true } })));
  assert.equal(s.content, whole.choices[0].message.content);
  assert.equal(s.finish, whole.choices[0].finish_reason);
  assert.equal(s.chunks[0].choices[0].delta.role, 'assistant');
  assert.ok(s.chunks.every((c) => c.object === 'chat.completion.chunk' && c.id === s.chunks[0].id));
  assert.deepEqual(s.usage.completion_tokens, whole.usage.completion_tokens);
  assert.equal(s.chunks.at(-1).choices.length, 0, 'the usage chunk comes last and has no choices');
});

test('draft events show the canvas forming', async () => {
  const s = await collect(await client.chat.completions.create(
    ask('Drafts please.', { seed: 5, stream: true, stream_options: { include_drafts: true } })));
  assert.ok(s.drafts.length >= 1);
  for (const d of s.drafts) {
    assert.equal(d.object, 'chat.completion.draft');
    assert.equal(typeof d.draft.text, 'string');
    assert.ok(d.draft.step >= 1 && d.draft.step <= 3);
  }
});

const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather for a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, unit: { type: 'string', enum: ['c', 'f'] } },
                  required: ['city'] },
  },
}];
const callText = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|><|tool_response>';

test('tool-call round trip: tools -> tool_calls -> tool message -> continuation', async () => {
  const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const first = await client.chat.completions.create({
    model: MODEL, messages, tools, seed: 1, max_tokens: 40, x_test_output: callText,
  });
  const choice = first.choices[0];
  assert.equal(choice.finish_reason, 'tool_calls');
  assert.equal(choice.message.content, null);
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris', unit: 'c' });

  messages.push(choice.message);
  messages.push({ role: 'tool', tool_call_id: call.id, content: JSON.stringify({ temp: 18, sky: 'clear' }) });
  const second = await client.chat.completions.create({
    model: MODEL, messages, tools, seed: 1, max_tokens: 8, max_denoising_steps: 3,
  });
  assert.equal(second.object, 'chat.completion');
  assert.ok(second.usage.prompt_tokens > first.usage.prompt_tokens);
  // The continuation extends the cached conversation instead of re-prefilling it.
  assert.ok(second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens / 2,
    JSON.stringify(second.usage));
});

test('streamed tool call arrives as a tool_calls delta', async () => {
  const s = await collect(await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Weather?' }], tools, stream: true, max_tokens: 40,
    x_test_output: callText,
  }));
  assert.equal(s.finish, 'tool_calls');
  assert.equal(s.toolCalls.length, 1);
  assert.equal(s.toolCalls[0].index, 0);
  assert.equal(s.toolCalls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(s.toolCalls[0].function.arguments), { city: 'Paris', unit: 'c' });
});

test('reasoning_content and stop sequences', async () => {
  const r = await client.chat.completions.create(ask('Think.', {
    reasoning_effort: 'high', x_test_output: '<|channel>thought\nweigh it\n<channel|>Yes, END of it<turn|>', stop: ['END'],
  }));
  assert.equal(r.choices[0].message.reasoning_content, 'weigh it');
  assert.equal(r.choices[0].message.content, 'Yes, ');
  assert.equal(r.choices[0].finish_reason, 'stop');
});

test('completions: text prompt, id prompt, streaming', async () => {
  const a = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', seed: 4, max_tokens: 6,
                                             max_denoising_steps: 2 });
  assert.equal(a.object, 'text_completion');
  assert.equal(typeof a.choices[0].text, 'string');
  const ids = await client.completions.create({ model: MODEL, prompt: [2, 9259, 3409], max_tokens: 4,
                                               max_denoising_steps: 2 });
  assert.equal(ids.usage.prompt_tokens, 3);
  let text = '';
  for await (const c of await client.completions.create({ model: MODEL, prompt: 'Once upon a time', seed: 4,
                                                         max_tokens: 6, max_denoising_steps: 2, stream: true })) {
    text += c.choices[0]?.text ?? '';
  }
  assert.equal(text, a.choices[0].text);
});

test('SDK error classes carry OpenAI error fields', async () => {
  await assert.rejects(client.chat.completions.create({ ...ask('x'), model: 'gpt-nope' }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError);
    assert.equal(e.code, 'model_not_found');
    assert.equal(e.param, 'model');
    return true;
  });
  await assert.rejects(client.chat.completions.create({ ...ask('x'), max_tokens: 'many' }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError);
    assert.equal(e.param, 'max_tokens');
    assert.equal(e.code, 'invalid_type');
    return true;
  });
  const anon = new OpenAI({ baseURL: `${BASE_URL}/v1`, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(anon.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});
